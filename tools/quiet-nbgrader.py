"""Keep nbgrader (installed with the [dev] extra, for the instructors' tests) out of the
students' JupyterLab: its lab extension and its four server extensions disabled in the
virtual environment (what `jupyter labextension disable` and `jupyter server extension
disable --sys-prefix` do, in one process: a few seconds instead of five interpreters).
Instructors: `jupyter labextension enable @jupyter/nbgrader`."""
from jupyter_server.extension.serverextension import toggle_server_extension_python
from jupyterlab.commands import disable_extension

disable_extension("@jupyter/nbgrader", level="sys_prefix")
for name in ("formgrader", "validate_assignment", "assignment_list", "course_list"):
    toggle_server_extension_python(f"nbgrader.server_extensions.{name}", False, sys_prefix=True)
