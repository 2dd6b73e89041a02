"""Build hook only (the project's metadata is in pyproject.toml): install the MEGATRAIN_DS switch.

The switch is one line in ``megatrain_ds_switch.pth`` at the root of site-packages. Python runs it
at every interpreter start; it costs one environment lookup and imports ``compat.switch`` only when
MEGATRAIN_DS=1 (see compat/switch.py). A ``.pth`` must sit in site-packages itself, so ``build_py``
writes it at the root of what becomes the wheel, for a normal install (build_lib) and an editable
one (the editable wheel's own files).
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "megatrain_ds_switch.pth"
PTH_LINE = "import os; os.environ.get('MEGATRAIN_DS') == '1' and __import__('compat.switch')\n"


class build_py_with_switch(build_py):
    def run(self):
        super().run()
        # setuptools' editable_wheel packs install_lib (its unpacked wheel), not build_lib
        if self.editable_mode:
            root = self.get_finalized_command("install").install_lib
        else:
            root = self.build_lib
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, PTH_NAME), "w") as f:
            f.write(PTH_LINE)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not self.editable_mode:
            outputs.append(os.path.join(self.build_lib, PTH_NAME))
        return outputs


setup(cmdclass={"build_py": build_py_with_switch})
