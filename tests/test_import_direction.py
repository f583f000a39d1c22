"""No package imports one above it: every import of megatron_lite, checked against the table of layers in
docs/architecture.md (an AST walk, so imports inside functions count too)."""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_lite")


def _layers() -> list[list[str]]:
    """The table's rows, ground floor first: each a list of units (a package's name, or a top-level module's)."""
    rows = []
    for line in open(os.path.join(ROOT, "docs", "architecture.md")):
        cells = line.split("|")
        if len(cells) < 4 or "megatron_lite/" not in cells[2] or "outside the package" in cells[1]:
            continue
        rows.append([re.sub(r"^megatron_lite/", "", name).rstrip("/").removesuffix(".py")
                     for name in re.findall(r"`([^`]+)`", cells[2])])
    return rows


def _unit(module: str) -> str | None:
    """``megatron_lite.data.gpt_dataset`` -> ``data``; None outside our packages (``megatron_lite.kernels`` is
    kernels/, installed under our name)."""
    parts = module.split(".")
    if parts[0] != "megatron_lite" or len(parts) < 2:
        return None
    on_disk = os.path.isdir(os.path.join(PACKAGE, parts[1])) or os.path.isfile(os.path.join(PACKAGE, f"{parts[1]}.py"))
    return parts[1] if on_disk else None


def _imports(path: str):
    """Every module a file imports (the package imports absolutely: a relative import is named as itself)."""
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            yield "." * node.level + (node.module or "")
        elif isinstance(node, ast.ImportFrom):
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _our_files():
    for directory, _, names in os.walk(PACKAGE):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                yield path, module


def test_every_package_is_in_the_table_once():
    units = [unit for row in _layers() for unit in row]
    on_disk = {name.removesuffix(".py") for name in os.listdir(PACKAGE)
               if name != "__init__.py" and (name.endswith(".py") or
                                             os.path.isfile(os.path.join(PACKAGE, name, "__init__.py")))}
    assert sorted(units) == sorted(set(units)) and set(units) == on_disk, (units, on_disk)


def test_no_import_goes_up_or_sideways():
    level = {unit: number for number, row in enumerate(_layers()) for unit in row}
    wrong = set()
    for path, module in _our_files():
        source = _unit(module)
        if source is None:  # megatron_lite/__init__.py, the package's version string
            continue
        for imported in _imports(path):
            if imported.startswith("."):
                wrong.add(f"{os.path.relpath(path, ROOT)} imports {imported}: import absolutely, so it is checked")
            target = _unit(imported)
            if target is not None and target != source and level[target] >= level[source]:
                wrong.add(f"{os.path.relpath(path, ROOT)} imports {imported} ({source} is not above {target})")
    assert not wrong, "imports against docs/architecture.md's table of layers:\n" + "\n".join(sorted(wrong))
