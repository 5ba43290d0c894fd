"""Synthetic PPD-style sessions: sizes, classes, rate, think time, validation."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from controller.sim.workloads import WorkloadConfig, WorkloadError, build_workload
from controller.sim.workloads.synthetic import PPD_CLASSES, PPD_CONTEXTS


def sessions(params: dict[str, Any], seed: int = 1) -> list[Any]:
    workload = build_workload(WorkloadConfig("synthetic", params=params))
    return list(workload.sessions(random.Random(seed)))


def test_explicit_sizes_build_growing_prompts() -> None:
    got = sessions(
        {
            "turns": 4,
            "turn1_input": 300,
            "turn1_output": 50,
            "append_input": 70,
            "append_output": 20,
            "think_s": 2.0,
            "qps": 2.0,
            "duration_s": 100.0,
        }
    )
    turns = got[0].turns
    assert [t.prompt_tokens for t in turns] == [300, 420, 510, 600]  # + previous output + 70
    assert [t.new_tokens for t in turns] == [300, 70, 70, 70]
    assert [t.context_tokens for t in turns] == [0, 350, 440, 530]
    assert [t.output_tokens for t in turns] == [50, 20, 20, 20]
    assert [t.max_tokens for t in turns] == [t.output_tokens for t in turns]
    assert [t.think_s for t in turns] == [0.0, 2.0, 2.0, 2.0]
    assert all(len(s.turns) == 4 for s in got)


@pytest.mark.parametrize("name", sorted(PPD_CLASSES))
def test_ppd_classes_set_the_later_turns(name: str) -> None:
    got = sessions({"class": name, "context": "large", "qps": 1.0, "duration_s": 50.0})
    first, second = got[0].turns
    assert (first.prompt_tokens, first.output_tokens) == PPD_CONTEXTS["large"]
    assert (second.new_tokens, second.output_tokens) == PPD_CLASSES[name]
    assert got[0].session_id.startswith(f"synthetic-large-{name}")


def test_paper_classes_named_in_the_issue() -> None:
    assert PPD_CLASSES["mid_bal"] == (128, 128)
    assert PPD_CLASSES["big_paste"] == (512, 64)
    assert PPD_CLASSES["long_gen"] == (32, 512)


def test_qps_is_the_overall_request_rate() -> None:
    got = sessions({"qps": 8.0, "turns": 4, "duration_s": 2000.0}, seed=3)
    requests = sum(len(s.turns) for s in got)
    assert requests / 2000.0 == pytest.approx(8.0, rel=0.05)
    assert len(got) / 2000.0 == pytest.approx(2.0, rel=0.05)
    assert all(0 <= s.start_s < 2000.0 for s in got)
    gaps = [b.start_s - a.start_s for a, b in itertools.pairwise(got)]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert cv == pytest.approx(1.0, abs=0.1)  # Poisson starts


def test_exponential_think_has_the_given_mean() -> None:
    got = sessions({"think": "exp", "think_s": 3.0, "qps": 10.0, "duration_s": 1000.0})
    thinks = [s.turns[1].think_s for s in got]
    assert sum(thinks) / len(thinks) == pytest.approx(3.0, rel=0.1)
    assert len(set(thinks)) > len(thinks) // 2


def test_same_seed_same_sessions() -> None:
    params = {"qps": 3.0, "think": "exp", "duration_s": 200.0}
    assert sessions(params, 5) == sessions(params, 5)
    assert sessions(params, 5) != sessions(params, 6)


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"qps": 0}, "qps"),
        ({"qps": -1.0}, "qps"),
        ({"turn1_input": -5}, "turn1_input"),
        ({"append_output": 0}, "append_output"),
        ({"turns": 0}, "turns"),
        ({"think_s": -1}, "think_s"),
        ({"class": "huge"}, "class"),
        ({"class": "mid_bal", "append_input": 10}, "append_input"),
        ({"context": "small", "turn1_output": 10}, "turn1_output"),
        ({"qsp": 1.0}, "qsp"),
        ({"turns": 2.5}, "turns"),
        ({"think": "poisson"}, "think"),
    ],
)
def test_bad_params_name_the_key(params: dict[str, Any], key: str) -> None:
    with pytest.raises(WorkloadError, match=rf"workload\.params\.{key}\b"):
        build_workload(WorkloadConfig("synthetic", params=params))
