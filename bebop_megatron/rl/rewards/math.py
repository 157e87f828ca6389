"""Exact-answer math grading: extract the final answer (``\\boxed{}``, ``####``, "the answer is",
else the last number) and compare by normalised string, exact rational value, or sympy."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

_NUM = r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+"


def _boxed(text: str) -> Optional[str]:
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> Optional[str]:
    b = _boxed(text)
    if b is not None:
        return b.strip()
    m = re.findall(r"####\s*(.+)", text)
    if m:
        return m[-1].strip()
    m = re.findall(r"answer is[:\s]*\$?([^\n$]+)", text, flags=re.IGNORECASE)
    if m:
        return m[-1].strip().rstrip(".")
    nums = re.findall(_NUM, text)
    return nums[-1] if nums else None


def normalize(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:mathrm|mathbf)\{([^}]*)\}", r"\1", s)
    for a, b in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("dfrac", "frac"),
                 ("tfrac", "frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", ""), ("%", ""), (" ", "")):
        s = s.replace(a, b)
    s = re.sub(r"^[a-zA-Z]\s*=", "", s)  # "x=3" -> "3"
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s.rstrip(".")


def _rational(s: str) -> Optional[Fraction]:
    m = re.fullmatch(r"\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if m:
        return Fraction(int(m.group(1)), int(m.group(2))) if int(m.group(2)) else None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _to_sympy(s: str):
    from sympy.parsing.sympy_parser import implicit_multiplication_application, parse_expr, standard_transformations

    if len(s) > 200:
        return None
    e = s
    for _ in range(5):  # nested \frac / \sqrt
        e = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", e)
        e = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", e)
    e = e.replace("\\cdot", "*").replace("\\times", "*").replace("\\pi", "pi").replace("^", "**")
    e = e.replace("{", "(").replace("}", ")")
    if "\\" in e:
        return None
    try:
        return parse_expr(e, transformations=standard_transformations + (implicit_multiplication_application,),
                          evaluate=True)
    except Exception:
        return None


def math_equal(pred: Optional[str], gold: str) -> bool:
    if pred is None:
        return False
    a, b = normalize(pred), normalize(gold)
    if a == b:
        return True
    pa, pb = _split_top(a), _split_top(b)
    if len(pa) > 1 or len(pb) > 1:  # tuples / lists: elementwise
        return len(pa) == len(pb) and all(math_equal(x, y) for x, y in zip(pa, pb))
    ra, rb = _rational(a), _rational(b)
    if ra is not None and rb is not None:
        return ra == rb
    ea, eb = _to_sympy(a), _to_sympy(b)
    if ea is None or eb is None:
        return False
    try:
        import sympy

        return bool(sympy.simplify(ea - eb) == 0)
    except Exception:
        return False


def _split_top(s: str) -> list[str]:
    s = s[1:-1] if len(s) > 1 and s[0] in "([" and s[-1] in ")]" else s
    parts, depth, cur = [], 0, ""
    for ch in s:
        depth += ch in "([{" and 1 or (ch in ")]}" and -1 or 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p for p in parts if p != ""]


def math_reward(completion: str, gold: str) -> float:
    return 1.0 if math_equal(extract_answer(completion), gold) else 0.0
