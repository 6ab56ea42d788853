"""The student edition: the kit an instructor hands out once lab NN's deadline has passed.

    python -m distlab.grading.course release OUT --through 04    # or --through none

writes, in the new folder ``OUT``:

- ``labs/`` whole, the README (with a note on what this edition holds), ``docs/``,
  ``Makefile``, ``pyproject.toml`` and ``tools/``: ``make lab``, ``make grade`` and the
  README's quick start work there as in the full kit;
- the library with the answers of labs up to NN and none of a later lab's: the files of
  the modules that the answers' manifest (:data:`distlab.grading.answers.ANSWERS`)
  names for any later exercise are left out (:func:`withheld`), and
  ``lib/distlab/edition.json`` lists them. Importing one there gives a module whose every
  name refuses, saying which lab it answers (:func:`distlab.runtime.absent.install_edition`),
  so library code that imports it still imports;
- the grader with its exercise tests, which students may read, like a course's public
  tests (an instructor's own tests stay with the instructor: ``--hidden-tests``);
- no ``solutions/``, no developers' ``tests/`` (the held-back wrong answers are there) and
  no CI files.

A module that answers exercises of several labs goes out with the last of them.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from distlab.grading import answers, labs
from distlab.runtime.absent import EDITION

KIT = Path(__file__).resolve().parents[3]  # a checkout of the full kit
# what an edition holds of the kit: these, less caches and build leftovers
CONTENTS = ("README.md", "Makefile", "pyproject.toml", "environment.yml", "labs", "lib", "docs",
            "tools")
_JUNK = ("__pycache__", "*.pyc", "*.egg-info", ".ipynb_checkpoints", "build")
MANIFEST = EDITION.name  # beside the package's __init__.py, in an edition only (read there)


def lab_number(lab: str) -> int:
    """``"05_zero"`` → 5."""
    return int(lab.split("_", 1)[0])


def parse_through(text: str, lab_names) -> int:
    """``--through``'s value: ``none`` → -1, else a lab's number (``04`` or ``04_data_parallel``)."""
    if text.lower() == "none":
        return -1
    match = re.fullmatch(r"(\d{1,2})(_\w+)?", text)
    numbers = sorted(lab_number(lab) for lab in lab_names)
    if not match or int(match.group(1)) not in numbers:
        known = ", ".join(f"{n:02d}" for n in numbers)
        raise ValueError(f"--through takes 'none' or a lab's number ({known}), got {text!r}")
    return int(match.group(1))


def withheld(through: int, lab_exercises: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Answer module → the lab it goes out with, for every module some exercise of a lab
    after ``through`` names (a module goes out with the last lab that names it)."""
    last: dict[str, str] = {}
    for lab in sorted(lab_exercises, key=lab_number):
        for module in answers.modules_of(lab_exercises[lab]):
            last[module] = lab
    return {m: lab for m, lab in sorted(last.items()) if lab_number(lab) > through}


def _module_files(package: Path, module: str) -> list[Path]:
    base = package.joinpath(*module.split(".")[1:])
    return [p for p in (base.with_suffix(".py"), base) if p.exists()]


def _readme_note(through: int, held: dict[str, str]) -> str:
    if through < 0:
        have = "none of the labs' answers"
    else:
        have = f"the library's answers to labs 00–{through:02d}"
    later = sorted(set(held.values()), key=lab_number)
    return (f"> **Student edition** ({'through none' if through < 0 else f'through lab {through:02d}'}):"
            f" this copy of the kit holds {have}. The answers to "
            f"{', '.join(later) if later else 'no lab'} are not in it: your instructor hands "
            f"them out after each deadline. `make lab` and `make grade` work as the quick "
            f"start below says; the developers' tests and `solutions/` are in the full kit "
            f"only.\n\n")


def release(out: Path, through: int, kit: Path = KIT) -> dict[str, str]:
    """Write the student edition through lab ``through`` (-1: none) to the new folder
    ``out``; return what it withholds (:func:`withheld`)."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists: name a new folder")
    if not (kit / "lib" / "distlab").is_dir() or not (kit / "labs").is_dir():
        raise FileNotFoundError(f"{kit} is not a checkout of the full kit (no lib/distlab or labs/)")
    held = withheld(through, labs.exercises())
    out.mkdir(parents=True)
    for name in CONTENTS:
        source = kit / name
        if source.is_dir():
            shutil.copytree(source, out / name, ignore=shutil.ignore_patterns(*_JUNK))
        elif source.is_file():
            shutil.copy2(source, out / name)
    package = out / "lib" / "distlab"
    for module in held:
        for path in _module_files(package, module):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    (package / MANIFEST).write_text(json.dumps(
        {"through": None if through < 0 else f"{through:02d}", "withheld": held}, indent=1) + "\n")
    readme = out / "README.md"
    readme.write_text(_readme_note(through, held) + readme.read_text())
    return held


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m distlab.grading.course release",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the new folder to write the edition to")
    parser.add_argument("--through", required=True, metavar="NN",
                        help="the last lab whose answers it holds (a number), or none")
    args = parser.parse_args(argv)
    try:
        through = parse_through(args.through, labs.exercises())
        held = release(args.out, through)
    except (ValueError, FileExistsError, FileNotFoundError) as exc:
        parser.error(str(exc))
    print(f"wrote {args.out}: the student edition through "
          f"{'none' if through < 0 else f'lab {through:02d}'}; withheld: "
          + (", ".join(held) if held else "nothing"))
    return 0
