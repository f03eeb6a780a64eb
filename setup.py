"""setuptools entry point. The package is pure Python: the CUDA sources are compiled at run time by NVRTC.

Building a wheel copies the files that have their one home at the repository root into the package, so that an
installed volta_train finds them beside its modules (volta_train/resources.py looks them up):

    csrc/*.cu, csrc/*.cuh   -> volta_train/_csrc/      the CUDA sources
    configs/**              -> volta_train/_configs/   accelerate, DeepSpeed, gpt_long and finetune configs
    data/samples/*.jsonl    -> volta_train/_data/samples/   the fine-tuning configs' sample data

MANIFEST.in puts the same directories into the sdist. Editable installs copy nothing: they read the checkout.

`python setup.py precompile [--arch sm_70]` fills the kernel cache ahead of time through the same compile
function the run-time path uses (see volta_train/kernels/nvrtc.py); it needs NVRTC but no GPU.
"""

import shutil
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# source directory at the root -> (directory inside the package, file patterns, recursive)
SHIPPED = {
    "csrc": ("_csrc", ("*.cu", "*.cuh"), False),
    "configs": ("_configs", ("*.yaml", "*.json", "*.md"), True),
    "data/samples": ("_data/samples", ("*.jsonl",), False),
}


def shipped_files():
    """(source, path inside the package) of every file SHIPPED names."""
    for source, (target, patterns, recursive) in SHIPPED.items():
        base = ROOT / source
        if not base.is_dir():
            raise FileNotFoundError(f"{base} is missing: a volta_train build needs csrc/, configs/ and data/samples/")
        for pattern in patterns:
            for path in sorted(base.rglob(pattern) if recursive else base.glob(pattern)):
                yield path, Path("volta_train") / target / path.relative_to(base)


class BuildPy(build_py):
    """build_py that also copies csrc/, configs/ and data/samples/ into the built package."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads csrc/ and configs/ from the checkout
        for source, relative in shipped_files():
            target = Path(self.build_lib) / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)

    def get_outputs(self, include_bytecode=True):
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs += [str(Path(self.build_lib) / relative) for _, relative in shipped_files()]
        return outputs


class Precompile(Command):
    description = "compile the shipped Volta kernel variants into the kernel cache (no GPU needed)"
    user_options = [("arch=", None, "target architecture, default sm_70")]

    def initialize_options(self):
        self.arch = "sm_70"

    def finalize_options(self):
        pass

    def run(self):
        from volta_train.kernels.precompile import precompile_all

        precompile_all(self.arch)


setup(cmdclass={"build_py": BuildPy, "precompile": Precompile})
