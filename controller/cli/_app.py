"""The typer apps every command module registers on (one file per command family)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from controller.config import Settings

app = typer.Typer(
    name="pdctl",
    help="pd-controller: closes the control loop of prefill/decode-disaggregated LLM serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help texts name config sections as "[store]"; rich markup would swallow them as tags.
    rich_markup_mode=None,
)
table_app = typer.Typer(help="Inspect lookup-table policy files.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks that print numbers.", no_args_is_help=True)
sim_app = typer.Typer(help="The simulated P/D cluster.", no_args_is_help=True)
config_app = typer.Typer(help="Configuration helpers.", no_args_is_help=True)

app.add_typer(table_app, name="table")
app.add_typer(bench_app, name="bench")
app.add_typer(sim_app, name="sim")
app.add_typer(config_app, name="config")

EXIT_BAD_INPUT = 2  # bad flags, config or input files: the operator must change something


def load_settings_or_exit(config: Path | None) -> Settings:
    """The typed settings of ``config`` (defaults when None); a bad file exits 2 with the
    reason on stderr instead of a traceback."""
    from controller.config import load_settings
    from controller.errors import ConfigError

    try:
        return load_settings(config)
    except ConfigError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None


def table_console() -> Any:
    """A rich Console for tables: on a terminal its own width; elsewhere (cron, CI, a pipe)
    200 columns, where rich's default 80 cut columns to "…" (push's ok and outcome)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)


def _probe(directory: Path) -> None:
    """Create and remove a file in ``directory`` (``os.access`` says yes to root, on /proc
    too); raises OSError."""
    import tempfile

    with tempfile.NamedTemporaryFile(dir=directory, prefix=".pdctl-probe-"):
        pass


def writable_dir_or_exit(path: Path, flag: str = "--out") -> Path:
    """``path`` made and checked writable before any long work, so that a run is not lost
    to an output directory that cannot take its results."""
    if path.exists() and not path.is_dir():  # mkdir said only "File exists"
        typer.echo(f"error: {flag} {path}: not a directory", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    try:
        path.mkdir(parents=True, exist_ok=True)
        _probe(path)
    except OSError as e:
        typer.echo(f"error: {flag} {path}: {e.strerror or e}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    return path


def writable_file_or_exit(path: Path, flag: str) -> Path:
    """``path`` can be written as a file: its directory exists and takes files, and it is
    not a directory, a device or a pipe itself."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        reason = "is a directory"
    elif path.exists() and not path.is_file():
        reason = "not a regular file (a device or a pipe)"
    elif not parent.is_dir():
        reason = f"no directory {parent}"
    else:
        try:
            _probe(parent)
        except OSError as e:
            reason = f"cannot write to {parent}: {e.strerror or e}"
        else:
            return path
    typer.echo(f"error: {flag} {path}: {reason}", err=True)
    raise typer.Exit(EXIT_BAD_INPUT)


def load_policy_or_exit(path: Path) -> Any:
    """Read and validate a policy file; on failure print every problem and exit 2."""
    from controller.policy import PolicyValidationError, loads

    try:
        data = path.read_bytes()
    except OSError as e:
        typer.echo(f"{path}: cannot read: {e.strerror or e}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    try:
        return loads(data)
    except PolicyValidationError as e:
        typer.echo(f"{path}: invalid policy, {len(e.problems)} problem(s):", err=True)
        for problem in e.problems:
            typer.echo(f"  {problem.path}: {problem.message}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except UnicodeDecodeError as e:
        typer.echo(f"{path}: invalid policy: not UTF-8 text ({e})", err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
