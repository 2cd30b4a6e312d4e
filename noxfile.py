"""Developer tasks. `nox -s typecheck tests` is the test command."""

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
    """mypy --strict over src/, tests/, examples/ and benchmarks/ (stubs for brainstate in typings/)."""
    session.install("-e", ".[typecheck]")
    session.run("mypy", "--strict", "src", "tests", "examples", "benchmarks")


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
    """Run the benchmarks and write their tables under benchmarks/results/."""
    session.install("-e", ".[bench]")
    session.run("python", "benchmarks/run.py", *session.posargs)
