"""Bad input an operator plausibly gives: one line naming the flag or value and exit 2,
before any long work starts, never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from controller.cli import app

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
SYNTHETIC = REPO / "scenarios" / "examples" / "synthetic.toml"


def _fails_cleanly(args: list[str], reason: str) -> str:
    result = runner.invoke(app, args)  # an uncaught exception exits 1 here
    err = result.stderr
    assert result.exit_code == 2, (args, result.exit_code, result.output, result.exception)
    assert reason in err, (args, err)
    return err


def test_bench_run_checks_out_before_the_run(tmp_path: Path) -> None:
    """The whole run's results were lost to an --out that could not be written, after it."""
    a_file = tmp_path / "p.json"
    a_file.write_text("{}")
    for out in ("/proc/pdctl-out", str(a_file)):
        err = _fails_cleanly(["bench", "run", str(SYNTHETIC), "--policy", "pd", "--out", out],
                             f"--out {out}")
        assert "replayed" not in err  # refused before the replay, not after it


def test_bench_run_policy_and_threshold_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": ')
    _fails_cleanly(["bench", "run", str(SYNTHETIC), "--policy", str(bad)], "invalid policy")
    _fails_cleanly(["bench", "run", str(SYNTHETIC), "--policy", "threshold",
                    "--threshold", "max_uncached_ratio=abc"], "--threshold")
    result = runner.invoke(app, ["bench", "run", str(SYNTHETIC), "--policy", "pd",
                                 "--short", "--threshold", "prefill_waiting=4"])
    assert result.exit_code == 0 and "--threshold has no effect" in result.stderr


def test_sim_serve_reports_a_bad_workload_parameter(tmp_path: Path) -> None:
    """Only building the workload checks [workload.params]; that happened inside the server's
    start and surfaced as a traceback."""
    scenario = tmp_path / "neg.toml"
    scenario.write_text(SYNTHETIC.read_text().replace("qps = 8", "qps = -8"))
    # A subprocess with a deadline: a server that did start would otherwise serve forever.
    done = subprocess.run([sys.executable, "-c", "from controller.cli import main; main()",
                           "sim", "serve", str(scenario)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert "workload.params.qps: must be > 0" in done.stderr and "Traceback" not in done.stderr
    _fails_cleanly(["sim", "serve", str(SYNTHETIC), "--host", "10.0.0.1"], "--host 10.0.0.1")


def test_table_show_checks_plot_before_printing(tmp_path: Path) -> None:
    from controller.policy import dumps
    from tests.cli.test_table_cmd import mixed_policy

    policy = tmp_path / "policy.json"
    policy.write_text(dumps(mixed_policy()))
    for plot, reason in ((tmp_path, "is a directory"), (tmp_path / "no" / "a.png", "no directory")):
        err = _fails_cleanly(["table", "show", str(policy), "--plot", str(plot)], reason)
        assert "--plot" in err
    result = runner.invoke(app, ["table", "show", str(policy), "--plot", str(tmp_path / "no")])
    assert result.exit_code == 0 and (tmp_path / "no").is_file()


def test_calibrate_active_rejects_nonsense_before_pushing(tmp_path: Path) -> None:
    """A context class of 0 or less, or an endpoint that is not a URL, used to go on to push
    forced policies to the routers."""
    config = tmp_path / "pd.toml"
    config.write_text('[routers]\ntargets = ["127.0.0.1:9"]\n'
                      f'[store]\nurl = "sqlite:///{tmp_path / "pd.db"}"\n')
    base = ["calibrate-active", "--config", str(config)]
    _fails_cleanly([*base, "--openai", "http://127.0.0.1:9/v1", "--contexts", "-5,0"],
                   "--contexts")
    _fails_cleanly([*base, "--openai", "http://127.0.0.1:9/v1", "--qps", "0"], "--qps")
    _fails_cleanly([*base, "--openai", "http://127.0.0.1:9/v1", "--contexts", "128,1.5"],
                   "--contexts: token counts are whole numbers, got 1.5")
    _fails_cleanly([*base, "--openai", "notaurl"], "--openai 'notaurl'")
    assert not (tmp_path / "pd.db").exists()


def _process_fails_cleanly(args: list[str], reason: str) -> str:
    """A long-running command as a subprocess with a deadline: one that did start would
    otherwise serve until killed."""
    done = subprocess.run([sys.executable, "-c", "from controller.cli import main; main()",
                           *args], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, (args, done.returncode, done.stderr)
    assert reason in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
    return done.stderr


def test_a_listen_port_in_use_is_one_line(tmp_path: Path) -> None:
    """Another daemon or agent on the port was an OSError traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        config = tmp_path / "pd.toml"
        config.write_text(f'[store]\nurl = "sqlite:///{tmp_path / "h.db"}"\n'
                          f'[routers]\ntargets = ["127.0.0.1:1"]\n'
                          f'[metrics]\nlisten = "{address}"\n')
        _process_fails_cleanly(["run", "--config", str(config)],
                               f"cannot listen on [metrics] listen {address}")
        _process_fails_cleanly(["router-agent", "--listen", "127.0.0.1:0",
                                "--metrics-listen", address],
                               f"cannot listen on --metrics-listen {address}")


def test_router_agent_checks_its_state_file_directory(tmp_path: Path) -> None:
    """It started, said ready, and then refused every push (persist_failed)."""
    missing = tmp_path / "no-such-dir" / "policy.json"
    _process_fails_cleanly(["router-agent", "--listen", "127.0.0.1:0",
                            "--state-file", str(missing)],
                           f"--state-file {missing}: no directory {missing.parent}")
    _process_fails_cleanly(["router-agent", "--listen", "127.0.0.1:0",
                            "--state-file", str(tmp_path)], "is a directory")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # a FIFO blocked the start for good; a device was renamed "corrupt"
    _process_fails_cleanly(["router-agent", "--listen", "127.0.0.1:0",
                            "--state-file", str(fifo)], "not a regular file")
    # os.access says yes to root on /proc; a temporary file there says no
    _process_fails_cleanly(["router-agent", "--listen", "127.0.0.1:0",
                            "--state-file", "/proc/pdctl-state.json"], "cannot write to /proc")
