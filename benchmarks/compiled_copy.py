"""A copy of this tree's package whose recording modules are compiled with Cython (the same
Python source, compiled as is: no type declarations), to weigh a compiled build against the pure
one. It is written as ``OUT/ampdoctor`` for the ``--ab OUT`` option of ``host_overhead.py`` and
``overhead_gpu.py``, which import it beside this tree's package as ``ampdoctor_ab`` (it is compiled
under that name, so the two copies share no module).

Not part of the product: an experiment for the question "would a compiled extension make the
recorder's host work cheap enough?" (benchmarks/README.md, tenth session). Needs Cython and a C
compiler with the Python headers.

Run:  python benchmarks/compiled_copy.py OUT [--jobs 8]
      python benchmarks/host_overhead.py --ab OUT           # CPU proxy: pure (this tree) against compiled
      python benchmarks/overhead_gpu.py --regimes 32x128 --no-others --ab OUT
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# the modules a recorded step runs through (hooks, slots and rows, the step boundary, the flush path)
HOT = ["watch", "rows", "session", "steps", "tensors", "attribution", "stats", "stats_cuda", "_stats_nvrtc"]

_SETUP = """
import sys
from setuptools import setup
from Cython.Build import cythonize
mods = sys.argv[1].split(",")
jobs = int(sys.argv[2])
sys.argv[1:] = ["build_ext", "--inplace", "--parallel", str(jobs)]
setup(ext_modules=cythonize(mods, nthreads=jobs, quiet=True,
                            compiler_directives={"language_level": 3, "binding": True, "annotation_typing": False}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    src = Path(__file__).resolve().parent.parent / "ampdoctor"
    work = Path(tempfile.mkdtemp(prefix="ampdoctor-cy-"))
    pkg = work / "ampdoctor_ab"
    shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (work / "setup_cy.py").write_text(_SETUP)
    mods = ",".join(f"ampdoctor_ab/{m}.py" for m in HOT)
    subprocess.run([sys.executable, "setup_cy.py", mods, str(args.jobs)], cwd=work, check=True)
    for m in HOT:  # the compiled module is imported; its source stays beside it only to be read
        if not list(pkg.glob(f"{m}.*.so")):
            sys.exit(f"{m} was not compiled")
        (pkg / f"{m}.py").unlink()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "ampdoctor").exists():
        shutil.rmtree(out / "ampdoctor")
    shutil.copytree(pkg, out / "ampdoctor", ignore=shutil.ignore_patterns("*.c", "build"))
    print(f"compiled copy: {out / 'ampdoctor'} ({', '.join(HOT)})")


if __name__ == "__main__":
    main()
