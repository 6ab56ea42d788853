"""The set-up files agree with each other and with what the README promises."""
import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_names_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"]) | set(project["optional-dependencies"]["dev"])
    pip_section, listed = False, set()
    for line in (ROOT / "environment.yml").read_text().splitlines():
        if line.strip() == "- pip:":
            pip_section = True
        elif pip_section and line.strip().startswith("- ") and not line.strip()[2:].startswith("-"):
            listed.add(line.strip()[2:].strip())
    assert listed == wanted, (f"only in environment.yml: {sorted(listed - wanted)}; "
                              f"only in pyproject.toml: {sorted(wanted - listed)}")


def test_torch_is_a_range_that_the_cpu_pin_satisfies():
    """The Makefile pins a CPU build; pyproject must accept it rather than pull another."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_req = next(d for d in deps if _name(d) == "torch")
    pin = re.search(r"TORCH_VERSION \?= ([\d.]+)", (ROOT / "Makefile").read_text()).group(1)
    floor = re.search(r">=([\d.]+)", torch_req).group(1)
    assert tuple(map(int, pin.split("."))) >= tuple(map(int, floor.split("."))), torch_req


def test_make_help_lists_every_target():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, re.MULTILINE))
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    listed = set(re.findall(r"^  make (\S+)", out, re.MULTILINE))
    assert listed == targets, f"missing from help: {targets - listed}"


def test_readme_quick_start_and_ci_use_the_make_targets():
    readme = (ROOT / "README.md").read_text()
    for command in ("make lab", "make test", "make grade"):
        assert command in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
