"""tools/import_graph.py: its counting on small graphs, and the package's imports that
point up the wings of docs/architecture.md held at their number (issue 53)."""

from docgen_loader import load_tool

# Module imports from a wing to one above it in docs/architecture.md's picture
# (`WING_ORDER`). Lower it when you remove one; never raise it: import down instead.
ARROWS_UP_THE_WINGS = 51


def _tool():
    return load_tool("import_graph")


def test_every_import_counts_but_a_script_block():
    tool = _tool()
    known = {"tputrain", "tputrain.a", "tputrain.b", "tputrain.c", "tputrain.w", "tputrain.w.d"}
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tputrain.b import B\n"
              "def f():\n    from tputrain import c\n"
              "if __name__ == '__main__':\n    import tputrain.w.d\n")
    assert tool.imports_of("tputrain.a", source, known) == {"tputrain.b", "tputrain.c"}
    # a package's lazy table and its relative imports
    init = "from .d import x\n_EXPORTS = {'A': 'tputrain.a'}\n"
    assert tool.imports_of("tputrain.w", init, known, is_package=True) == {"tputrain.w.d",
                                                                           "tputrain.a"}
    assert tool.imports_of("tputrain.w.d", "from .. import b\n", known) == {"tputrain.b"}


def test_rooms_fold_a_folder_into_one_and_levels_count_files_and_folders():
    tool = _tool()
    tree = {"tputrain/__init__.py": "", "tputrain/top.py": "from tputrain.w import d\n",
            "tputrain/w/__init__.py": "", "tputrain/w/d.py": "import tputrain.w.e\n",
            "tputrain/w/e.py": "from tputrain import top\n"}
    modules = tool.module_graph(tree)
    assert modules["tputrain.w.d"] == {"tputrain.w.e"}
    assert tool.room_graph(modules, tree) == {"__init__.py": set(), "top.py": {"w"},
                                              "w": {"top.py"}}
    assert tool.levels(tree) == [(2, 1), (3, 0)]


def test_the_fewest_arrows_back_leave_layers_and_the_greedy_order_finds_them_too():
    tool = _tool()
    # a -> b -> c -> a and a -> c: leaving out c -> a alone breaks the cycle
    graph = {"a": {"b", "c"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    back, layer = tool.layered(graph)
    assert back == [("c", "a")]
    assert layer == {"c": 1, "b": 2, "a": 3, "d": 4}
    assert tool.cycles(graph) == [["a", "b", "c"]]
    # two cycles sharing a room: two arrows back, whichever order finds them
    graph = {"a": {"b"}, "b": {"c", "e"}, "c": {"a"}, "e": {"f"}, "f": {"b"}, "g": set()}
    part = tool.cycles(graph)[0]
    exact, greedy = tool._exact_order(part, graph), tool._greedy_order(part, graph)
    assert tool._back(exact, graph) == tool._back(greedy, graph) == 2


def test_arrows_up_the_wings_follow_the_order_of_the_picture():
    tool = _tool()
    modules = {"tputrain.loop.step": {"tputrain.runtime.plan", "tputrain.data.context"},
               "tputrain.runtime.plan": {"tputrain.options"}, "tputrain.options": set(),
               "tputrain.data.context": set()}
    assert tool.arrows_up_the_wings(modules) == [("tputrain.loop.step", "tputrain.runtime.plan"),
                                                 ("tputrain.runtime.plan", "tputrain.options")]


def test_no_import_is_added_up_the_wings():
    """An arrow up ties a low wing to a high one (docs/architecture.md, "Imports that
    still point up"); `python tools/import_graph.py --up` lists them."""
    tool = _tool()
    up = tool.arrows_up_the_wings(tool.module_graph(tool.read_tree(None)))
    assert len(up) <= ARROWS_UP_THE_WINGS, "\n".join(f"{a} -> {b}" for a, b in up)
    assert len(up) == ARROWS_UP_THE_WINGS, f"{len(up)} now: lower ARROWS_UP_THE_WINGS to it"
