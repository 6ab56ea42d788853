"""An instructor's hidden tests: test files of their own that only their grader runs
(``python -m distlab.grading ... --hidden-tests DIR``), one point per test of the exercise
they name, read as a submission is, run from a private copy of the kit's tests, and absent
from the filesystem of the ranks that run students' code."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

from distlab.grading import labs, notebook, sandbox
from distlab.grading.labs import TESTS


@dataclasses.dataclass(frozen=True)
class HiddenTests:
    """An instructor's own tests, ready to run (:func:`hidden_tests`)."""
    tests_dir: Path                       # a private copy of the kit's tests, with them
    files: dict[str, tuple[Path, ...]]    # exercise → its hidden test files, in tests_dir
    unseen: tuple[str, ...]               # folders graded ranks must not see


MAX_HIDDEN_BYTES = 1 << 20  # a hidden test file's size, at most


def _read(folder: Path, folder_fd: int, name: str) -> bytes:
    """File ``name`` of the open folder, read as a submission is
    (:func:`distlab.grading.notebook.read_plain`), at most :data:`MAX_HIDDEN_BYTES`."""
    try:
        return notebook.read_plain(name, MAX_HIDDEN_BYTES, dir_fd=folder_fd)
    except notebook.Unreadable as exc:
        where = folder / name
        raise ValueError(
            f"hidden test {where} is a symbolic link: put the file itself there"
            if exc.why == "link" else
            f"hidden test {where} is larger than {MAX_HIDDEN_BYTES >> 20} MiB: split it into "
            f"several test_<exercise>_<part>.py files" if exc.why == "too large" else
            f"hidden test {where} is not a regular file with one name: put a plain copy of "
            f"it there" if exc.why in ("not regular", "other names") else
            f"hidden test {where} cannot be opened ({exc.detail})") from None


def _exercise_named(stem: str, names) -> str | None:
    """The exercise of ``names`` that a hidden test's file name names: ``test_NAME`` or
    ``test_NAME_<anything>`` (the longest such NAME)."""
    found = [n for n in names if stem == f"test_{n}" or stem.startswith(f"test_{n}_")]
    return max(found, key=len, default=None)


@contextlib.contextmanager
def hidden_tests(folder: Path, graded, tests_dir: Path = TESTS):
    """An instructor's tests for the labs ``graded`` (:class:`HiddenTests`, while the
    context lasts): ``folder``'s files ``test_<exercise>.py`` and
    ``test_<exercise>_<anything>.py``, each declaring ``NOTEBOOK = "<lab>"`` and using the
    kit's fixtures and helper modules as the kit's tests do. Read as the grader reads a
    submission (:func:`_read`), copied with the kit's tests into a private folder that
    pytest runs from; that folder and ``folder`` are absent from graded ranks. A ValueError
    naming the file and the fix for a file that declares no lab, a lab not graded, or an
    exercise its lab lacks, that does not compile, or that pytest cannot collect (checked
    here: at grading time it would stop every test of the run); for any other ``.py``
    file (helpers and a conftest.py cannot come); and for a folder inside one that graded
    ranks read (:func:`distlab.grading.sandbox.readable_by_ranks`)."""
    try:
        folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"--hidden-tests {folder}: not a folder ({exc.strerror}); give the "
                         f"folder itself, not a link to it") from None
    every = labs.exercises(tests_dir)
    with tempfile.TemporaryDirectory(prefix="distlab-hidden-") as private:
        try:
            names = sorted(n for n in os.listdir(folder_fd) if n.endswith(".py"))
            others = [n for n in names if not n.startswith("test_")]
            if others or not names:
                raise ValueError(
                    f"--hidden-tests {folder}: " + (f"{', '.join(others)} is not a test file; "
                    f"only test_<exercise>.py files are run, so helpers and a conftest.py "
                    f"cannot come: move their code into the test files" if others else
                    "no test_<exercise>.py file there"))
            private = os.path.realpath(private)
            for place in (os.path.realpath(folder), private):
                seen = sandbox.readable_by_ranks(place)
                if seen:
                    raise ValueError(
                        f"{place} is inside {seen}, which graded ranks can read (the Python "
                        f"installation and the folders on Python's path, the one the grader "
                        f"was started in included): start the grader in another folder, or " +
                        ("set TMPDIR outside it" if place == private else
                         "keep hidden tests elsewhere"))
            # laid out as in the kit: the conftest finds its checkout four folders up
            run_dir = Path(private) / TESTS.relative_to(TESTS.parents[3])
            shutil.copytree(tests_dir, run_dir, ignore=shutil.ignore_patterns("__pycache__"))
            files: dict[str, list[Path]] = {}
            for i, name in enumerate(names):
                source = _read(folder, folder_fd, name)
                try:
                    lab = labs.declared_lab(_placed(run_dir / f"hidden_{i}", name, source))
                except (SyntaxError, ValueError) as exc:
                    raise ValueError(f"hidden test {folder / name} does not compile ({exc}): "
                                     f"fix it") from None
                exercise = _exercise_named(Path(name).stem, every.get(lab, ()))
                fix = (f"declare the lab it tests at its top, e.g. NOTEBOOK = "
                       f"{sorted(graded)[0] if graded else next(iter(every))!r}")
                if lab is None:
                    raise ValueError(f"hidden test {folder / name} declares no lab: {fix}")
                if lab not in every:
                    raise ValueError(f"hidden test {folder / name} declares NOTEBOOK = {lab!r}, "
                                     f"which is no lab (the labs: {', '.join(every)}): {fix}")
                if lab not in graded:
                    raise ValueError(f"hidden test {folder / name} is for {lab}, but the "
                                     f"notebooks graded are of "
                                     f"{', '.join(sorted(graded)) or 'no lab'}: "
                                     f"grade it with {lab}'s notebooks, or move it out of "
                                     f"{folder}")
                if exercise is None:
                    raise ValueError(f"hidden test {folder / name}: {lab} has no exercise "
                                     f"that its name names; name it test_<exercise>.py or "
                                     f"test_<exercise>_<anything>.py after one of "
                                     f"{', '.join(every[lab])}")
                # named as the kit's file, so the fixtures and the report see its exercise
                (run_dir / f"hidden_{i}" / name).rename(
                    copy := run_dir / f"hidden_{i}" / f"test_{exercise}.py")
                try:  # one that fails to import would stop every test of the run
                    labs.test_counts([exercise], copy.parent)
                except RuntimeError as exc:
                    why = "; ".join(line[1:].strip() for line in str(exc).splitlines()
                                    if line.startswith("E ")) or "no test outside the gpu tiers"
                    raise ValueError(f"hidden test {folder / name} cannot be collected "
                                     f"({why}): fix it") from None
                files.setdefault(exercise, []).append(copy)
        finally:
            os.close(folder_fd)
        yield HiddenTests(run_dir, {n: tuple(f) for n, f in files.items()},
                          (os.path.realpath(folder), private))


def _placed(package: Path, name: str, source: bytes) -> Path:
    """``source`` as file ``name`` of a new package folder (its own, so that its module
    name is not the kit's test's)."""
    package.mkdir()
    (package / "__init__.py").write_bytes(b"")
    (package / name).write_bytes(source)
    return package / name
