"""The hint a report points to is chosen by what failed (issue 32): by a phrase of the
failing check's message, none for the student's own exception, whose message names the
student's line in the exercise cell rather than a torch frame."""
from distlab.grading import hints, output
from distlab.runtime.errors import RankError

TITLES = {1: "which moments?", 3: "why does dropping references free nothing?",
          4: "how do equal pieces carry uneven shards?"}
DECLARED = {"test_keeps_only_this_ranks_shard": {"uneven shards lost": 4, "unit.shard": 1},
            "test_frees": {"stay allocated": 3}}
TEST = "test_ZeRO3Unit.py::test_keeps_only_this_ranks_shard[1]"


def test_the_pointer_follows_the_check_that_failed():
    assert hints.pointer(DECLARED, TITLES, TEST, "ZeRO3Unit", "rank 0 of 2: ... (uneven shards "
                         "lost) ...") == ("open Hint 4 (how do equal pieces carry uneven "
                                          "shards?) under ZeRO3Unit")
    assert hints.pointer(DECLARED, TITLES, TEST, "ZeRO3Unit",
                         "unit.shard must be an nn.Parameter").startswith("open Hint 1 ")
    # the same test, a check no phrase names: no pointer rather than a wrong one
    assert hints.pointer(DECLARED, TITLES, TEST, "ZeRO3Unit", "something else") == ""
    # older files: a number per test still works
    assert hints.pointer({"test_x": 3}, TITLES, "t.py::test_x", "e", "anything").startswith(
        "open Hint 3 ")


def _raised(tmp_path, etype, message):
    """A RankError as the launcher builds it, raised in the student's module (written as
    the grader writes it: exercise cells after a header, each after its marker)."""
    module = tmp_path / "student_05_zero.py"
    module.write_text('"""header"""\nimport torch\n\n\n# --- exercise ZeRO3Unit\n'
                      'class ZeRO3Unit:\n    def gather(self):\n'
                      '        return self.full[0:4].view(2, 2)\n')
    tb = ("Traceback (most recent call last):\n"
          '  File "/x/distlab/runtime/worker.py", line 88, in run\n    out = fn(*args)\n'
          '  File "/x/torch/nn/modules/module.py", line 1790, in _call_impl\n'
          "    args_result = hook(self, args)\n"
          f'  File "{module}", line 8, in gather\n'
          "    return self.full[0:4].view(2, 2)\n"
          '  File "/x/torch/_tensor.py", line 41, in wrapped\n    return f(*args)\n'
          f"{etype}: {message}\n")
    return RankError(f"rank 1 raised {etype}: {message}\n\n{tb}", 1, etype, tb, None, message)


def test_the_students_own_exception_names_their_line_and_gets_no_pointer(tmp_path):
    """Views built on a freed storage (the ZeRO3Unit trial): torch's "setStorage ... out
    of bounds" names the student's line in the ZeRO3Unit cell, not torch's frame, and no
    hint is pointed to."""
    exc = _raised(tmp_path, "RuntimeError", "setStorage: sizes [2, 2], strides [2, 1], storage "
                  "offset 0, and itemsize 8 requiring a storage size of 32 are out of bounds "
                  "for storage of size 0")
    message = output.rank_error(exc)
    assert message.startswith("rank 1: your code raised RuntimeError: setStorage"), message
    assert message.endswith("(line 3 of the ZeRO3Unit cell, in gather: "
                            "return self.full[0:4].view(2, 2))"), message
    assert "torch/_tensor.py" not in message
    assert hints.pointer(DECLARED, TITLES, TEST, "ZeRO3Unit", message) == ""


def test_gloos_raw_peer_errors_are_explained(tmp_path):
    message = output.rank_error(_raised(tmp_path, "RuntimeError",
                                        "[gloo/transport/tcp/pair.cc:571] Pair is not connected"))
    assert "a rank of the group passed where torch.distributed expects a global rank" in message


def test_an_error_outside_the_students_code_keeps_the_deepest_frame(tmp_path):
    tb = ('Traceback (most recent call last):\n  File "/x/grading/exercises/test_a.py", '
          'line 9, in rank_run\n    return out["x"]\nKeyError: \'x\'\n')
    exc = RankError("rank 0 raised KeyError: 'x'\n\n" + tb, 0, "KeyError", tb, None, "'x'")
    message = output.rank_error(exc)
    assert output.RAISED not in message and "test_a.py\", line 9" in message, message
