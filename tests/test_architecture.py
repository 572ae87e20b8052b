"""The house rules of issue 25, read from the source: one direction between packages, no import circle
(function-level imports count), no private name imported from another module, no module over ~400 lines
but the wire schema."""

from tests.architecture_tools import LAYERS, cycles, import_graph, imports_of, package_cycles, project_modules

MAX_LINES = 400
# shared/wire/schema.py is the mesh's message schema: one dataclass per frame, read as one table
LONG_ALLOWED = {"shared.wire.schema"}
# shared/ keeps its concepts in rooms (wire/, auth/, telemetry/, planning/, net/, ...): at its top level only what
# every service reads, so a newcomer finds a module by its concept
SHARED_TOP_LEVEL_MAX = 12


def test_no_import_cycle_between_modules():
    assert cycles(import_graph(project_modules())) == []


def test_no_import_cycle_between_packages():
    assert package_cycles(import_graph(project_modules())) == []


def test_packages_import_only_downwards():
    modules = project_modules()
    upward = []
    for name in modules:
        layer = LAYERS.index(name.split(".")[0])
        for imp in imports_of(name, modules):
            if LAYERS.index(imp.target.split(".")[0]) > layer:
                upward.append(f"{name}:{imp.line} imports {imp.target}")
    assert upward == []


def test_no_private_name_is_imported_from_another_module():
    modules = project_modules()
    private = [
        f"{imp.importer}:{imp.line} imports {imp.target}.{name}"
        for module in modules
        for imp in imports_of(module, modules)
        for name in imp.names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert private == []


def test_modules_hold_one_thing():
    too_long = {
        name: len(path.read_text().splitlines()) for name, path in project_modules().items() if name not in LONG_ALLOWED
    }
    assert {name: n for name, n in too_long.items() if n > MAX_LINES} == {}


def test_shared_keeps_a_small_top_level():
    top = sorted(
        name
        for name, path in project_modules().items()
        if name.startswith("shared.") and name.count(".") == 1 and path.name != "__init__.py"
    )
    assert len(top) <= SHARED_TOP_LEVEL_MAX, top
