"""Structure rules of the package, continued from test_structure.py (its docstring lists them all):
each package's face (``__all__``) and what reaches past it, the engine's attributes read outside
the engine's files, another package's private fields, and the host store's tiers."""

import ast
import os
import sys

from tests.unit.test_structure import PACKAGE, _module_names, _package_files


# -------------------------------------------------------------------------------------------- faces
# Each package declares its face (issue 49): its ``__init__`` re-exports, and lists in ``__all__``,
# the names other packages and users may use (as torch.distributed.fsdp._fully_shard's ``__init__``
# and every torchtitan package do). A package reaches another only through that face: ``from ..host
# import LayerStates``, never ``from ..host.layer_state import LayerStates``.
def _write_tree(root, files: dict[str, str]) -> None:
    """A package's files under ``root``, by their paths relative to it."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _static_all(tree: ast.Module) -> list[str] | None:
    """The names a module's ``__all__`` lists, read from its source (string literals, and ``*NAME``
    of a module-level tuple, list or dict: its elements or keys); None when it assigns no
    ``__all__``."""
    values = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            values[node.targets[0].id] = node.value
    if "__all__" not in values:
        return None
    names = []
    for e in getattr(values["__all__"], "elts", []):
        if isinstance(e, ast.Constant):
            names.append(e.value)
        elif isinstance(e, ast.Starred) and isinstance(e.value, ast.Name) and e.value.id in values:
            source = values[e.value.id]
            names += [
                k.value for k in (source.keys if isinstance(source, ast.Dict) else source.elts)
            ]
    return names


def _home(module: str) -> str | None:
    """The first-level package a dotted module name is in (``pkg.host`` for ``pkg.host.a``); None at
    the top."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else None


def _face_violations(package_dir: str) -> list[str]:
    """Every name one package takes from another other than through its face: ``from <pkg.Q.mod>
    import X`` (a module below the face, relative or absolute, at any depth of the code), ``from
    <pkg.Q> import X`` with X not in Q's ``__all__``, and ``import pkg.Q.mod``. Imports inside one
    package, and of the top-level modules, are free."""
    modules = _module_names(package_dir)
    top = os.path.basename(package_dir)
    packages = {m for m, p in modules.items() if p.endswith("__init__.py") and m.count(".") == 1}
    faces = {}
    for package in packages:
        with open(modules[package]) as f:
            faces[package] = _static_all(ast.parse(f.read()))
    out = []
    for module, path in sorted(modules.items()):
        here = _home(module) if _home(module) in packages else None
        container = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        rel = os.path.relpath(path, os.path.dirname(package_dir))
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in sorted(
            (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))),
            key=lambda n: n.lineno,
        ):
            if isinstance(node, ast.Import):
                out += [
                    f"{rel}:{node.lineno} import {a.name}"
                    for a in node.names
                    if _home(a.name) in packages and _home(a.name) not in (here, a.name)
                ]
                continue
            if node.level:
                parts = container.split(".")
                base = ".".join(
                    parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])
                )
            else:
                base = node.module or ""
            there = _home(base)
            if base == top or there not in packages or there == here:
                continue
            for a in node.names:
                if base != there:
                    out.append(
                        f"{rel}:{node.lineno} from {base} import {a.name} (not through {there})"
                    )
                elif faces[there] is None or a.name not in faces[there]:
                    out.append(
                        f"{rel}:{node.lineno} from {base} import {a.name} (not in {there}.__all__)"
                    )
    return out


def test_packages_reach_each_other_through_their_faces():
    found = _face_violations(PACKAGE)
    assert not found, (
        f"{len(found)} name(s) taken past a package's face (import them from the package, and list "
        f"them in its __all__): {found}"
    )


def test_the_face_checker_sees_what_passes_its_face(tmp_path):
    files = {
        "__init__.py": "from .host import X\n",  # a top-level module, through the face: fine
        "host/__init__.py": "from .a import X\n__all__ = ['X']\n",
        "host/a.py": "X = 1\nY = 2\n",
        "host/b.py": "from .a import Y\nfrom pkg.host.a import X\n",  # inside its own package: fine
        "stream/__init__.py": "__all__ = []\n",
        "stream/c.py": "from ..host.a import X\nfrom ..host import X\nfrom ..host import Y\ndef "
        "f():\n"
        "    from pkg.host.a import Y\nimport pkg.host.a\nimport pkg.host\nfrom .. import host\n",
    }
    _write_tree(tmp_path / "pkg", files)
    assert _face_violations(str(tmp_path / "pkg")) == [
        "pkg/stream/c.py:1 from pkg.host.a import X (not through pkg.host)",
        "pkg/stream/c.py:3 from pkg.host import Y (not in pkg.host.__all__)",
        "pkg/stream/c.py:5 from pkg.host.a import Y (not through pkg.host)",
        "pkg/stream/c.py:6 import pkg.host.a",
    ]


def _packages_without_all(package_dir: str) -> list[str]:
    """Every package ``__init__`` of the tree (subpackages of subpackages too) that assigns no
    ``__all__``."""
    out = []
    for module, path in sorted(_module_names(package_dir).items()):
        if path.endswith("__init__.py") and module != os.path.basename(package_dir):
            with open(path) as f:
                if _static_all(ast.parse(f.read(), path)) is None:
                    out.append(module)
    return out


def _unresolved_all(module) -> list[str]:
    """The names of ``module.__all__`` that are not attributes of it (a lazy ``__getattr__`` one
    included)."""
    missing = []
    for name in module.__all__:
        try:
            getattr(module, name)
        except AttributeError:
            missing.append(name)
    return missing


def test_every_package_declares_its_face():
    import importlib

    assert not _packages_without_all(PACKAGE), "packages without __all__ (the names others may use)"
    unresolved = {}
    for module, path in _module_names(PACKAGE).items():
        if path.endswith("__init__.py") and module != "megatrain_ds":
            missing = _unresolved_all(importlib.import_module(module))
            if missing:
                unresolved[module] = missing
    assert not unresolved, f"names in __all__ that the package does not have: {unresolved}"


def test_the_all_checkers_see_a_missing_face(tmp_path, monkeypatch):
    import importlib

    for name, text in {
        "__init__.py": "",
        "a/__init__.py": "X = 1\n",
        "b/__init__.py": "import importlib\nX = 1\n_LAZY = {'L': ('m', 'L')}\n"
        "__all__ = ['X', 'Y', *_LAZY]\n"
        "def __getattr__(name):\n    if name in _LAZY:\n"
        "        return getattr(importlib.import_module(__name__ + '.m'), name)\n"
        "    raise AttributeError(name)\n",
        "b/m.py": "L = 2\n",
    }.items():
        (tmp_path / "facepkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "facepkg" / name).write_text(text)
    assert _packages_without_all(str(tmp_path / "facepkg")) == ["facepkg.a"]
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert _unresolved_all(importlib.import_module("facepkg.b")) == ["Y"]  # L resolves lazily
    finally:
        for name in [m for m in sys.modules if m == "facepkg" or m.startswith("facepkg.")]:
            del sys.modules[name]


# --------------------------------------------------------------------------- what others reach into
# Issue 49: the engine's parts are handed what they need (one bundle each), not the engine to read
# from; a package asks another's objects, never reads their private fields; the layer state answers
# where layer i lives (no ``home.layer is None`` branch, no reading the store's tiers from outside
# host/).
ENGINE_READS_LIMIT = 30  # engine.<attr> reads outside ENGINE_FILES, all files together
# the engine, its builder, its surface
ENGINE_FILES = {"engine.py", "training/engine_build.py", "api/surface.py"}
ENGINE_NAMES = ("engine", "eng")
# the host store's tiers, host/ only
STORE_FIELDS = ("device_state", "hold", "owned", "on_disk", "grad_direct")
STORE_RECEIVERS = ("store", "states", "layer_states")  # names the host store / layer states go by


def _engine_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, ``receiver.attr``) of every read of an attribute of the engine: on a name
    ``engine``/``eng`` or on an ``x.engine``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            v = node.value
            if (isinstance(v, ast.Name) and v.id in ENGINE_NAMES) or (
                isinstance(v, ast.Attribute) and v.attr == "engine"
            ):
                out.append((node.lineno, f"{ast.unparse(v)}.{node.attr}"))
    return out


def _engine_reads_outside(package_dir: str) -> list[str]:
    out = []
    for rel, path in (
        (os.path.relpath(p, package_dir), p) for p in _module_names(package_dir).values()
    ):
        if rel.replace(os.sep, "/") in ENGINE_FILES:
            continue
        with open(path) as f:
            out += [
                f"{rel}:{line} {what}" for line, what in _engine_reads(ast.parse(f.read(), path))
            ]
    return sorted(out)


def test_engine_attributes_are_read_by_the_engine_alone():
    found = _engine_reads_outside(PACKAGE)
    assert len(found) <= ENGINE_READS_LIMIT, (
        f"{len(found)} engine.<attr> reads outside {sorted(ENGINE_FILES)} "
        f"(at most {ENGINE_READS_LIMIT}: hand the part what it needs): {found}"
    )


def _private_reads(package_dir: str) -> list[str]:
    """Every read ``obj._name`` (obj not ``self``/``cls``) in a package where ``_name`` is a field
    or method of classes of other packages only (``self._name = ...``, ``def _name``, a class
    attribute ``_name``). A private name no class of ours defines (torch's ``module._buffers``,
    ``torch._C``) is not ours: not counted. The top-level modules count as one package."""
    modules = _module_names(package_dir)
    trees = {}
    for module, path in modules.items():
        with open(path) as f:
            trees[module] = ast.parse(f.read(), path)

    packages = {
        m.split(".")[1]
        for m, p in modules.items()
        if p.endswith("__init__.py") and m.count(".") == 1
    }

    def home(module):
        return (
            module.split(".")[1]
            if module.count(".") >= 1 and module.split(".")[1] in packages
            else "top"
        )

    def private(name):
        return name.startswith("_") and not name.startswith("__")

    defined = {}  # _name -> packages whose classes define it
    for module, tree in trees.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names = set()
            for item in cls.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                    first = item.args.args[0].arg if item.args.args else None
                    for node in ast.walk(item):
                        if (
                            isinstance(node, ast.Attribute)
                            and isinstance(node.ctx, ast.Store)
                            and isinstance(node.value, ast.Name)
                            and node.value.id == first
                        ):
                            names.add(node.attr)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    for t in item.targets if isinstance(item, ast.Assign) else [item.target]:
                        if isinstance(t, ast.Name):
                            names.add(t.id)
            for name in filter(private, names):
                defined.setdefault(name, set()).add(home(module))
    out = []
    for module, tree in sorted(trees.items()):
        here = home(module)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Load)
                and private(node.attr)
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and node.attr in defined
                and here not in defined[node.attr]
            ):
                rel = os.path.relpath(modules[module], package_dir)
                out.append(
                    (
                        rel,
                        node.lineno,
                        f"{ast.unparse(node.value)}.{node.attr} "
                        f"(defined in {', '.join(sorted(defined[node.attr]))})",
                    )
                )
    return [f"{rel}:{line} {what}" for rel, line, what in sorted(out)]


def test_no_package_reads_another_packages_private_fields():
    found = _private_reads(PACKAGE)
    assert not found, (
        f"{len(found)} read(s) of another package's private field (ask the object instead): {found}"
    )


def _layer_none_branches(tree: ast.AST) -> list[int]:
    """Lines of every ``<x>.layer is None`` / ``<x>.layer is not None`` (either side)."""
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Compare)
            and len(node.ops) == 1
            and isinstance(node.ops[0], (ast.Is, ast.IsNot))
        ):
            sides = (node.left, node.comparators[0])
            if any(isinstance(s, ast.Attribute) and s.attr == "layer" for s in sides) and any(
                isinstance(s, ast.Constant) and s.value is None for s in sides
            ):
                out.append(node.lineno)
    return sorted(out)


def test_no_branch_on_whether_a_home_is_a_layer():
    found = []
    for rel, path in _package_files():
        with open(path) as f:
            found += [
                f"megatrain_ds/{rel}:{line}"
                for line in _layer_none_branches(ast.parse(f.read(), path))
            ]
    assert not found, (
        f"{len(found)} branch(es) on home.layer is None (the home answers for itself): {found}"
    )


def _store_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every read of the host store's tiers (``STORE_FIELDS``) on a receiver named
    like the store or the layer states (``store``, ``self.store``, ``self.parts.states``,
    ``states[i]``, ...)."""

    def store_like(v):
        while isinstance(v, ast.Subscript):
            v = v.value
        return (isinstance(v, ast.Name) and v.id in STORE_RECEIVERS) or (
            isinstance(v, ast.Attribute) and v.attr in STORE_RECEIVERS
        )

    return [
        (node.lineno, f"{ast.unparse(node.value)}.{node.attr}")
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Load)
        and node.attr in STORE_FIELDS
        and store_like(node.value)
    ]


def test_the_store_tiers_are_read_in_host_only():
    found = []
    for rel, path in _package_files():
        if rel.startswith("host" + os.sep):
            continue
        with open(path) as f:
            found += [
                f"megatrain_ds/{rel}:{line} {what}"
                for line, what in _store_reads(ast.parse(f.read(), path))
            ]
    assert not found, (
        f"{len(found)} read(s) of the store's tiers outside host/ (ask the layer state): {found}"
    )


def test_the_reach_checkers_see_what_they_look_for(tmp_path):
    src = (
        "def f(engine, eng, x, self):\n"
        "    engine.store\n    eng.step()\n    x.engine.decisions.wire\n    self.engine = engine\n"
        "    engine.a = 1\n"
        "    if home.layer is None or None is not self.home.layer or home.layer == 1:\n"
        "        store.hold\n        self.parts.states.owned()\n        states[2].device_state\n"
        "        plan.owned\n        self.store.grad_direct[0]\n        self.store.on_disk(1)\n"
    )
    tree = ast.parse(src)
    assert _engine_reads(tree) == [(2, "engine.store"), (3, "eng.step"), (4, "x.engine.decisions")]
    assert _layer_none_branches(tree) == [7, 7]
    assert sorted(_store_reads(tree)) == [
        (8, "store.hold"),
        (9, "self.parts.states.owned"),
        (10, "states[2].device_state"),
        (12, "self.store.grad_direct"),
        (13, "self.store.on_disk"),
    ]
    files = {
        "__init__.py": "",
        "engine.py": "class E:\n    _top = 1\n",
        "host/__init__.py": "",
        "host/a.py": "class S:\n    def __init__(self):\n        self._tier = 1\n"
        "    def _fold(self):\n        return self._tier\n",
        "stream/__init__.py": "",
        "stream/b.py": "def g(s, m, self):\n    return s._tier, s._fold(), m._buffers, self._tier, "
        "s._top\n",
        "stream/c.py": "class T:\n    _fold = None\n    def h(self, s):\n        return s._fold\n",
    }
    _write_tree(tmp_path / "pkg", files)
    assert _private_reads(str(tmp_path / "pkg")) == [
        "stream/b.py:2 s._tier (defined in host)",
        "stream/b.py:2 s._top (defined in top)",
    ]
