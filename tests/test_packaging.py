"""One package, `deltaserve`: its wheel holds nothing else, its parts import only under that name, and nothing in
the environment (Hugging Face's `kernels`, a user's own `model.py`) is shadowed or shadows it."""

import ast
import importlib.util
import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("runtime", "devices", "model", "kernels", "tools")


def python(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_wheel_holds_only_deltaserve(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), ROOT], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("deltaserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"deltaserve", wheel.name.split("-py")[0] + ".dist-info"}, tops
    for part in PARTS:
        assert f"deltaserve/{part}/__init__.py" in names, part
    assert "deltaserve/model/data/corpus.txt" in names  # the tokenizer's training text travels with the model
    assert not any(n.startswith("deltaserve/tests") for n in names)


def test_the_parts_import_only_as_deltaserve_and_beside_a_users_own_modules(tmp_path):
    for part in PARTS:
        (tmp_path / f"{part}.py").write_text("raise SystemExit('the user module was imported')\n")
    done = python("import deltaserve.model, deltaserve.runtime, deltaserve.kernels.ops\n"
                  "from deltaserve import AsyncEngine, EngineArgs, SamplingParams, RequestOutput, __version__\n"
                  "print(deltaserve.model.__file__)", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(os.path.join(ROOT, "model"))
    for f in tmp_path.glob("*.py"):
        f.unlink()
    for part in PARTS:  # absent, or another distribution's (Hugging Face's `kernels`), never our folder
        done = python(f"import {part}; print({part}.__file__)", tmp_path)
        if done.returncode:
            assert "ModuleNotFoundError" in done.stderr, (part, done.stderr)
        else:
            assert not done.stdout.strip().startswith(ROOT), (part, done.stdout)


def test_hugging_faces_kernels_and_ours_live_in_one_process(tmp_path):
    code = "import transformers, deltaserve, deltaserve.kernels.gemv\n"
    if importlib.util.find_spec("kernels") is not None:  # transformers >= 5.25 brings it
        code += f"import kernels\nassert not kernels.__file__.startswith({ROOT!r}), kernels.__file__\n"
    code += "from transformers import Qwen3_5ForCausalLM\nprint('ok')"
    done = python(code, tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr


def _imports(part: str) -> dict[str, set[str]]:
    """File -> the modules it imports (absolute names; a relative import stays inside its part)."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, part)):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            tree = ast.parse(open(path, encoding="utf-8").read(), path)
            modules = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules |= {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom):
                    modules.add(f"deltaserve.{part}" if node.level else node.module)
            found[os.path.relpath(path, ROOT)] = modules
    return found


def test_the_runtime_imports_neither_torch_nor_the_tools():
    offending = {path: sorted(m for m in modules if m.split(".")[0] in ("torch", "triton", "tools")
                              or m.startswith("deltaserve.tools"))
                 for path, modules in _imports("runtime").items()}
    assert not any(offending.values()), offending


def test_no_import_cycle_between_the_parts():
    uses = {part: {m.split(".")[1] for modules in _imports(part).values() for m in modules
                   if m.startswith("deltaserve.") and m.split(".")[1] in PARTS and m.split(".")[1] != part}
            for part in PARTS}
    assert "tools" not in set().union(*(uses[p] for p in PARTS if p != "tools")), uses
    order, left = [], dict(uses)
    while left:  # peel off the parts that use no part still left; a cycle leaves some that never go
        free = [p for p, used in left.items() if not used & set(left)]
        assert free, f"import cycle among {sorted(left)}: {left}"
        order += free
        for p in free:
            del left[p]
    assert order.index("kernels") < order.index("model") < order.index("devices") < order.index("runtime"), order
