"""Rewards: math equivalence, synthetic tasks, and code run in a sandbox that contains hostile programs."""

import os
import uuid

import pytest

from bebop_megatron.rl.rewards import code_reward, extract_answer, make_tasks, math_equal, math_reward, synthetic_reward
from bebop_megatron.rl.rewards.sandbox import SandboxLimits, run_python

FAST = SandboxLimits(cpu_seconds=2, wall_seconds=4, memory_mb=256)  # hostile programs: hit the limits quickly
# correct programs must pass however loaded the machine is (a 4 s wall limit failed under a busy suite)
ROOMY = SandboxLimits(cpu_seconds=20, wall_seconds=60, memory_mb=256)


@pytest.mark.parametrize("completion,gold", [
    ("so the result is \\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}"),
    ("#### 1,000", "1000"),
    ("The answer is $2\\sqrt{2}$.", "\\sqrt{8}"),
    ("\\boxed{x = 3}", "3"),
    ("\\boxed{(1, \\frac{1}{2})}", "(1,0.5)"),
    ("we get 12 apples, then 7 more: 19", "19"),
    ("\\boxed{\\text{45}^\\circ}", "45"),
    ("\\boxed{2\\pi}", "2*pi"),
])
def test_math_equivalent(completion, gold):
    assert math_reward(completion, gold) == 1.0


@pytest.mark.parametrize("completion,gold", [
    ("\\boxed{0.51}", "1/2"), ("\\boxed{3}", "-3"), ("no number here", "4"), ("\\boxed{(1,2)}", "(1,2,3)"),
    ("\\boxed{x^2}", "x^3"),
])
def test_math_not_equivalent(completion, gold):
    assert math_reward(completion, gold) == 0.0


def test_extract_answer_nested_boxed():
    assert extract_answer("first \\boxed{1} then \\boxed{\\frac{a}{\\sqrt{b}}}") == "\\frac{a}{\\sqrt{b}}"
    assert math_equal(None, "1") is False


def test_synthetic_tasks_and_reward():
    tasks = make_tasks(50, seed=1)
    assert tasks == make_tasks(50, seed=1) and len({t.prompt for t in tasks}) > 30
    t = tasks[0]
    assert synthetic_reward(t.answer + "; 3+4=7;", t.answer) == 1.0
    assert synthetic_reward("x" + t.answer + ";", t.answer) == 0.0
    arith = make_tasks(20, seed=2, kind="arithmetic")
    for task in arith:
        assert str(eval(task.prompt.rstrip("="))) == task.answer


SOLUTION = "```python\nn = int(input())\nprint(n * 2)\n```"
TESTS = [{"input": "3", "output": "6"}, {"input": "10", "output": "20"}]


def test_code_reward_scores_correct_and_partial():
    assert code_reward(SOLUTION, TESTS, ROOMY) == 1.0
    assert code_reward("```python\nn=int(input())\nprint(6 if n == 3 else 0)\n```", TESTS, ROOMY) == 0.5
    assert code_reward("def f(x): return x + 1", "assert f(1) == 2", ROOMY) == 1.0
    assert code_reward("def f(x): return x", "assert f(1) == 2", ROOMY) == 0.0


@pytest.mark.parametrize("name,code", [
    ("infinite loop", "while True: pass"),
    ("sleeping", "import time\ntime.sleep(60)"),
    ("fork bomb", "import os\nwhile True: os.fork()"),
    ("multiprocessing bomb", "import multiprocessing as m\nwhile True: m.Process(target=print).start()"),
    ("subprocess", "import subprocess\nsubprocess.run(['sh', '-c', 'sleep 30'])"),
    ("memory hog", "x = []\nwhile True: x.append(bytearray(10**7))"),
    ("huge allocation", "x = bytearray(8 * 1024**3)"),
    ("network", "import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)"),
    ("ctypes escape", "import ctypes\nctypes.CDLL(None).system(b'true')"),
    ("output flood", "while True: print('x' * 10000)"),
])
def test_hostile_programs_are_contained_and_score_zero(name, code):
    r = run_python(code, limits=FAST)
    assert not r.ok and r.seconds < FAST.wall_seconds + 3, (name, r)
    assert code_reward("```python\n" + code + "\nprint(6)\n```", [{"input": "3", "output": "6"}], FAST) == 0.0


def test_writes_outside_the_sandbox_are_refused():
    target = f"/tmp/bebop_sandbox_escape_{uuid.uuid4().hex}"
    for code in (f"open({target!r}, 'w').write('x')",
                 f"import os\nfd = os.open({target!r}, os.O_CREAT | os.O_WRONLY)\nos.write(fd, b'x')",
                 f"import pathlib\npathlib.Path({target!r}).write_text('x')",
                 "import os\nos.remove('/etc/hostname')"):
        r = run_python(code, limits=FAST)
        assert not r.ok and "sandbox" in r.stderr, r.stderr
        assert not os.path.exists(target)
    assert os.path.exists("/etc/hostname")
    # inside its own folder it may write
    assert run_python("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())", limits=ROOMY).stdout == "ok\n"


def test_no_process_outlives_the_sandbox():
    import psutil

    before = {p.pid for p in psutil.process_iter()}
    run_python("import time\nwhile True: time.sleep(0.1)", limits=SandboxLimits(wall_seconds=1))
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if p.pid not in before
                 and "sandbox_main.py" in " ".join(p.info["cmdline"] or [])]
    assert not leftovers
