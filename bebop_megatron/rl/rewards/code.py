"""Code rewards: run the generated program against tests inside the sandbox."""

from __future__ import annotations

import re
from typing import Optional, Sequence

from bebop_megatron.rl.rewards.sandbox import SandboxLimits, run_python


def extract_code(completion: str) -> str:
    """The last fenced code block (```python or ```), else the whole completion."""
    blocks = re.findall(r"```(?:python|py)?\s*\n(.*?)```", completion, flags=re.DOTALL)
    return blocks[-1] if blocks else completion


def code_reward(completion: str, tests: Sequence[dict] | str, limits: Optional[SandboxLimits] = None) -> float:
    """Fraction of tests passed.

    ``tests`` is either a list of ``{"input": stdin, "output": expected stdout}`` cases, or a string of
    assertion code appended to the program (one run: 1.0 if it exits cleanly). Anything that times
    out, crashes, exceeds a limit or touches what the sandbox forbids scores 0 for that test.
    """
    code = extract_code(completion)
    if isinstance(tests, str):
        return 1.0 if run_python(code + "\n\n" + tests, limits=limits).ok else 0.0
    if not tests:
        raise ValueError("code_reward needs at least one test")
    passed = 0
    for t in tests:
        r = run_python(code, stdin=str(t.get("input", "")), limits=limits)
        if r.ok and not r.truncated and r.stdout.strip() == str(t["output"]).strip():
            passed += 1
    return passed / len(tests)
