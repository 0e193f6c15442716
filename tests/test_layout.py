"""How the code is layered, and the public API a notebook user sees.

The library (`s3djax`, and the kernels below it) imports no script folder; `train/` stands beside
`infer/`, not above it; both share `s3djax.cli`. `import s3djax` lists its public names and each
one reads well with help()."""

import ast
import inspect
import pathlib
import pydoc

import pytest

import s3djax

ROOT = pathlib.Path(__file__).resolve().parent.parent
# folder -> the top-level packages its files must not import
FORBIDDEN = {"s3djax": {"train", "infer", "benchmarks"}, "pallas_kernels": {"train", "infer", "benchmarks"},
             "cpu_kernels": {"train", "infer", "benchmarks"}, "train": {"infer", "benchmarks"}}


def imported_packages(path: pathlib.Path) -> set[str]:
    """The top-level package of every import in a file, at any depth (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_import_reaches_up_or_across(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    bad = {str(f.relative_to(ROOT)): sorted(imported_packages(f) & FORBIDDEN[folder]) for f in files}
    assert {f: names for f, names in bad.items() if names} == {}


def test_the_import_check_sees_nested_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    from infer.cli import run\n    import train.loop as loop\n")
    assert imported_packages(src) == {"os", "infer", "train"}


def test_dir_lists_the_public_names():
    listed = dir(s3djax)
    assert set(s3djax.__all__) <= set(listed)
    assert {"Generator", "Output", "Stream", "UserError"} <= set(s3djax.__all__)
    for name in s3djax.__all__:
        assert getattr(s3djax, name).__module__.startswith("s3djax.")
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        s3djax.nothing


def public_members(cls):
    """(name, object) of each public method and property the class itself defines."""
    for name, value in vars(cls).items():
        if name.startswith("_") or not (inspect.isfunction(value) or isinstance(value, (property, classmethod))):
            continue
        yield name, value.__func__ if isinstance(value, classmethod) else value


@pytest.mark.parametrize("name", s3djax.__all__)
def test_every_public_name_has_a_docstring(name):
    obj = getattr(s3djax, name)
    assert inspect.getdoc(obj) and not inspect.getdoc(obj).startswith(f"{name}(")  # not dataclass's generated one
    if inspect.isclass(obj):
        undocumented = [member for member, value in public_members(obj) if not (value.__doc__ or "").strip()]
        assert undocumented == []
    assert inspect.getdoc(obj).splitlines()[0] in pydoc.render_doc(obj)  # what help() shows


def test_the_package_docstring_names_every_public_name():
    assert all(f"`{name}`" in s3djax.__doc__ for name in s3djax.__all__)
