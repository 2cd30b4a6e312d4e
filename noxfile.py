"""Developer tasks. `nox -s typecheck tests` is the test command."""

import pathlib
import shutil
import sys

import nox

nox.options.sessions = ["typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the test suite (jaxtyping + beartype at full strength, float64 oracles) on
    two worker processes; pass pytest arguments after ``--`` to run a subset instead
    (e.g. ``nox -s tests -- -m "not slow"``)."""
    session.install("-e", ".[tests]")
    session.run("pytest", *(session.posargs or ["-n", "2", "--dist", "loadscope"]))


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict over src/, tests/, examples/ and benchmarks/ (stubs for brainstate in
    typings/); then a user's view: typing_check/user_code.py checked with ``mypy --strict
    --disallow-any-expr`` against the package installed (not editable) in a separate
    virtual environment, from outside the repository (no typings/, no mypy settings)."""
    session.install("-e", ".[typecheck]")
    session.run("mypy", "--strict", "src", "tests", "examples", "benchmarks")
    user = pathlib.Path(session.create_tmp()).resolve() / "usertypes"
    python = user / "venv" / "bin" / "python"
    if not python.exists():  # kept between local runs, as nox keeps its own; fresh in CI
        session.run(sys.executable, "-m", "venv", str(user / "venv"), external=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    session.run(*pip, ".", "mypy>=1.15", external=True)
    session.run(*pip, "--no-deps", "--force-reinstall", ".", external=True)  # this checkout
    user.mkdir(parents=True, exist_ok=True)  # not made by the venv under --install-only
    shutil.copy("typing_check/user_code.py", user / "user_code.py")
    with session.chdir(user):
        session.run(
            str(python), "-m", "mypy", "--strict", "--disallow-any-expr", "--warn-unreachable",
            "user_code.py", external=True,
        )  # fmt: skip


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over the whole project."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "src", "tests", "benchmarks", "examples", "noxfile.py")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation site (mkdocs-material + mkdocstrings) in strict mode."""
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Run the demo (`python -m etrax demo`)."""
    session.install("-e", ".[demo]")
    session.run("python", "-m", "etrax", "demo", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Run the benchmarks and write their tables under benchmarks/results/
    (``nox -s bench -- peer`` runs only the side-by-side comparison with braintrace,
    ``nox -s bench -- scale`` only the hidden-size and depth sweeps, ``nox -s bench --
    chunks`` the per-step time of each online rule by chunk length, ``nox -s bench --
    compile`` what XLA:CPU's faster-compiling options cost per step, ``nox -s bench --
    parts`` where pp-prop's time goes, part by part).

    braintrace 0.2.6 is the peer measured by ``benchmarks/bench_peer.py``; it is
    installed here only, never in the test or typecheck environments."""
    session.install("-e", ".[bench]", "braintrace==0.2.6")
    session.run("python", "benchmarks/run.py", *session.posargs)
