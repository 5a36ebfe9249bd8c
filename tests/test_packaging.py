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


def python(code: str, cwd, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": path} if path else None  # path: a site-packages to put first
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def _parts_are_ours_alone(cwd, path: str | None = None) -> None:
    """Each part's top-level name is absent or another distribution's, never our folder."""
    for part in PARTS:
        done = python(f"import {part}; print({part}.__file__)", cwd, path)
        if done.returncode:
            assert "ModuleNotFoundError" in done.stderr, (part, done.stderr)
        else:  # a venv inside the checkout (`python -m venv .venv`) holds other packages under ROOT: not ours
            assert not done.stdout.strip().startswith(os.path.join(ROOT, part, "")), (part, done.stdout)


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
    info = wheel.name.split("-py")[0] + ".dist-info"
    metadata = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and f"{info}/licenses/LICENSE" in names
    linux_only = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: ")
                  and line.split()[1].split(">")[0].split(";")[0] in ("triton", "cuda-python", "nccl4py")]
    assert len(linux_only) == 3 and all("sys_platform == \"linux\"" in line for line in linux_only), linux_only


def test_the_cpu_path_serves_without_the_gpu_packages(tmp_path):
    """Where Triton, cuda-python and nccl4py are absent (macOS has no wheels for them), the package imports and
    the CPU engine serves."""
    code = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("triton", "cuda", "nccl4py"):
            raise ImportError(f"no module named {name!r}")
sys.meta_path.insert(0, Absent())
import asyncio
from deltaserve import AsyncEngine, EngineArgs, SamplingParams
async def main():
    async with AsyncEngine(EngineArgs(device="cpu", cpu_memory_bytes=32 << 20, max_model_len=128)) as engine:
        async for out in engine.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True)):
            pass
        print("served", len(out.token_ids))
asyncio.run(main())
assert not any(m.split(".")[0] in ("triton", "cuda", "nccl4py") for m in sys.modules)
"""
    done = python(code, tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("served 3"), done.stderr[-2000:]


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
    _parts_are_ours_alone(tmp_path)


def test_a_venv_inside_the_checkout_is_not_taken_for_the_project(tmp_path):
    """The common habit: `python -m venv .venv` in the repository. Its packages (here a `kernels` and a `model`,
    as Hugging Face's and a user's) sit under the checkout, yet are not ours."""
    import shutil
    import tempfile

    venv = tempfile.mkdtemp(prefix=".venv-", dir=ROOT)
    try:
        site = os.path.join(venv, "lib", "site-packages")
        for name in ("kernels", "model"):
            os.makedirs(os.path.join(site, name))
            open(os.path.join(site, name, "__init__.py"), "w").close()
        _parts_are_ours_alone(tmp_path, site)
    finally:
        shutil.rmtree(venv)


def test_hugging_faces_kernels_and_ours_live_in_one_process(tmp_path):
    code = "import transformers, deltaserve, deltaserve.kernels.gemv\n"
    if importlib.util.find_spec("kernels") is not None:  # transformers >= 5.25 brings it
        code += f"import kernels\nassert not kernels.__file__.startswith({os.path.join(ROOT, 'kernels', '')!r}), " \
            "kernels.__file__\n"
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
