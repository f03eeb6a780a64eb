"""setuptools entry point. The package is pure Python: the CUDA sources are compiled at run time by NVRTC.

`python setup.py precompile [--arch sm_70]` fills the kernel cache ahead of time through the same compile
function the run-time path uses (see volta_train/kernels/nvrtc.py); it needs NVRTC but no GPU.
"""

from setuptools import Command, setup


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


setup(cmdclass={"precompile": Precompile})
