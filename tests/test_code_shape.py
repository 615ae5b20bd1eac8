"""The kernels and the module are built from parts: no function in include/ or src/ is longer than 150 lines (a
lambda counts toward the function that holds it)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "include", ROOT / "src"]
MAX_LINES = 150

pytestmark = pytest.mark.skipif(not (ROOT / "include").exists(), reason="needs the source tree")

# A brace-delimited body's head (the code since the previous statement) that is not a function's.
_SCOPE = re.compile(r"^(template\s*<.*>\s*)?(namespace|struct|class|union|enum|extern)\b", re.S)
# What may follow a function's parameter list before its body: qualifiers, a trailing return type, attributes.
_AFTER_PARAMS = re.compile(r"^(\s|const|noexcept|override|final|mutable|->[^{;]*|__attribute__\(\(.*\)\))*$", re.S)


def _code(text: str) -> str:
    """text with its comments and string and character literals blanked, line breaks kept."""
    pattern = re.compile(r'//[^\n]*|/\*.*?\*/|"(\\.|[^"\\\n])*"|\'(\\.|[^\'\\\n])*\'', re.S)
    return pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def _is_function_head(head: str) -> bool:
    head = head.strip()
    if not head.endswith(")") and ")" not in head:
        return False
    if _SCOPE.match(head) or head.startswith("#"):
        return False
    return _AFTER_PARAMS.match(head[head.rfind(")") + 1 :]) is not None


def function_lengths(text: str) -> list[tuple[int, int]]:
    """(first line, lines) of each function body at namespace or class scope, from its opening brace to its closing
    one."""
    code = _code(text)
    stack: list[tuple[bool, int]] = []  # (a function's body, the line of its brace)
    found = []
    head_start = 0
    for i, c in enumerate(code):
        if c == "{":
            in_function = any(is_fn for is_fn, _ in stack)
            line = code.count("\n", 0, i) + 1
            stack.append((not in_function and _is_function_head(code[head_start:i]), line))
            head_start = i + 1
        elif c == "}":
            is_fn, line = stack.pop()
            if is_fn:
                found.append((line, code.count("\n", 0, i) + 2 - line))
            head_start = i + 1
        elif c == ";":
            head_start = i + 1
    assert not stack, "unbalanced braces"
    return found


def test_the_scanner_measures_functions_and_ignores_other_scopes():
    text = """namespace a {
struct S : B {
  int x{1};
  S(int y) : x(y) {}
  __device__ int f() const {
    auto g = [&](int z) { return z; };  // a lambda: part of f
    return g(x);
  }
};
}
"""
    assert function_lengths(text) == [(4, 1), (5, 4)]


def _too_long(paths) -> list[str]:
    found = []
    for path in paths:
        for line, lines in function_lengths(path.read_text()):
            if lines > MAX_LINES:
                found.append(f"{path.relative_to(ROOT).as_posix()}:{line}: {lines} lines")
    return found


def _sources():
    for root in SOURCES:
        for path in sorted(root.rglob("*")):
            if path.suffix in (".h", ".cuh", ".cpp", ".cu"):
                yield path


def test_no_function_is_longer_than_150_lines():
    too_long = _too_long(_sources())
    assert not too_long, "functions longer than 150 lines (split them into phases):\n" + "\n".join(too_long)
