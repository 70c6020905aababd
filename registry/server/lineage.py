"""An artifact's lineage as a layered graph: its ancestors to the left, its descendants to
the right, drawn as inline SVG on the server (no script in the browser).

The walk is bounded (node count and depth), so a page never follows a lineage forever;
a graph that was cut says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

from kvgraft.catalog import Catalog
from kvgraft.catalog.browse import names_of, parents_of
from kvgraft.digest import Digest

MAX_NODES = 40
MAX_DEPTH = 8
_W, _H, _GAP_X, _GAP_Y, _PAD = 210, 46, 60, 14, 10


@dataclass(frozen=True, slots=True)
class Node:
    digest: Digest
    level: int  # < 0 ancestors, 0 the artifact itself, > 0 descendants
    names: tuple[str, ...]
    present: bool  # False: a parent the catalog does not hold
    hidden: bool = False  # in no repository the viewer may read

    @property
    def label(self) -> str:
        if self.hidden:
            return "not visible to you"
        return self.names[0] if self.names else self.digest.short


@dataclass(frozen=True, slots=True)
class Graph:
    root: Digest
    nodes: tuple[Node, ...]
    edges: tuple[tuple[Digest, Digest], ...]  # (parent, child)
    truncated: bool

    def parents(self, digest: Digest) -> list[Digest]:
        return [p for p, c in self.edges if c == digest]

    def children(self, digest: Digest) -> list[Digest]:
        return [c for p, c in self.edges if p == digest]


def build(catalog: Catalog, root: Digest, parents: Sequence[Digest], *,
          max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH) -> Graph:
    """Walk parents (from the manifests) and children (manifests naming a parent) of
    `root` breadth-first, up to `max_nodes` nodes and `max_depth` steps each way."""
    level: dict[Digest, int] = {root: 0}
    present: dict[Digest, bool] = {root: True}
    truncated = False

    frontier, depth = list(dict.fromkeys(parents)), 1
    edges = {(p, root) for p in frontier}
    while frontier:
        fresh = [p for p in frontier if p not in level]
        if len(level) + len(fresh) > max_nodes or depth > max_depth:
            truncated = True
            break
        for p in fresh:
            level[p] = -depth
        known = parents_of(catalog, fresh)
        nxt = []
        for p in fresh:
            present[p] = p in known
            for q in known.get(p, ()):
                edges.add((q, p))
                if q not in level:
                    nxt.append(q)
        frontier, depth = list(dict.fromkeys(nxt)), depth + 1

    frontier, depth, cut = [root], 1, False
    while frontier and not cut:
        nxt = []
        for d in frontier:
            for c in catalog.children(d):
                if c in level and level[c] <= 0:
                    continue  # an ancestor again: only a corrupt catalog makes a cycle
                if c not in level:
                    if len(level) >= max_nodes or depth > max_depth:
                        cut = True
                        break
                    level[c], present[c] = depth, True
                    nxt.append(c)
                edges.add((d, c))
        frontier, depth = nxt, depth + 1

    kept = {(p, c) for p, c in edges if p in level and c in level}
    _layer(level, kept)
    names = names_of(catalog, list(level))
    nodes = tuple(Node(d, lv, names.get(d, ()), present.get(d, True))
                  for d, lv in level.items())
    return Graph(root, nodes, tuple(sorted(kept, key=lambda e: (str(e[0]), str(e[1])))),
                 truncated or cut)


def repository_of(name: str) -> str:
    """The repository of a `repository:tag` (or bare repository) name."""
    return name.partition(":")[0]


def restrict(graph: Graph, visible: Callable[[str], bool]) -> Graph:
    """The graph as a viewer who may read only the repositories `visible` accepts sees
    it: names of other repositories are dropped; an ancestor left with none stays as an
    anonymous node (its digest is in the manifests the viewer reads anyway), a descendant
    left with none goes, and with it whatever was reachable only through it."""
    nodes: dict[Digest, Node] = {}
    for n in graph.nodes:
        names = tuple(x for x in n.names if visible(repository_of(x)))
        hidden = n.digest != graph.root and n.present and not names
        if hidden and n.level > 0:
            continue
        nodes[n.digest] = Node(n.digest, n.level, names, n.present, hidden)
    edges = [(p, c) for p, c in graph.edges if p in nodes and c in nodes]
    reach, todo = {graph.root}, [graph.root]
    while todo:
        d = todo.pop()
        for p, c in edges:
            if p == d and c not in reach:
                reach.add(c)
                todo.append(c)
    keep = {d for d, n in nodes.items() if n.level <= 0 or d in reach}
    return Graph(graph.root, tuple(n for d, n in nodes.items() if d in keep),
                 tuple((p, c) for p, c in edges if p in keep and c in keep), graph.truncated)


def _layer(level: dict[Digest, int], edges: set[tuple[Digest, Digest]]) -> None:
    """Longest-path layers: every edge points right, even where a lineage joins itself
    (a graft whose parent and grandparent are both its parents)."""
    for _ in range(len(level)):
        changed = False
        for p, c in edges:
            if level[c] <= 0 and level[p] > level[c] - 1:
                level[p], changed = level[c] - 1, True
            if level[p] >= 0 and level[c] > 0 and level[c] < level[p] + 1:
                level[c], changed = level[p] + 1, True
        if not changed:
            return


def _clip(text: str, n: int = 28) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def svg(graph: Graph, href: Callable[[Digest], str]) -> Markup:
    """The graph as an inline SVG document; every text is escaped, every node links to
    its artifact page (a parent missing from the catalog links nowhere)."""
    columns: dict[int, list[Node]] = {}
    for n in graph.nodes:
        columns.setdefault(n.level, []).append(n)
    first = min(columns)
    rows = max(len(c) for c in columns.values())
    height = _PAD * 2 + rows * _H + (rows - 1) * _GAP_Y
    width = _PAD * 2 + len(columns) * _W + (len(columns) - 1) * _GAP_X
    where: dict[Digest, tuple[int, int]] = {}
    for lv, col in columns.items():
        top = (height - (len(col) * _H + (len(col) - 1) * _GAP_Y)) // 2
        for i, n in enumerate(col):
            where[n.digest] = (_PAD + (lv - first) * (_W + _GAP_X), top + i * (_H + _GAP_Y))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="lineage" role="img" '
           f'width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
           "<title>lineage</title>",
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
           'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z"/></marker></defs>']
    for p, c in graph.edges:
        (px, py), (cx, cy) = where[p], where[c]
        x1, y1, x2, y2 = px + _W, py + _H // 2, cx, cy + _H // 2
        mid = (x1 + x2) // 2
        out.append(f'<path class="edge" d="M{x1},{y1} C{mid},{y1} {mid},{y2} {x2},{y2}" '
                   f'marker-end="url(#arrow)"/>')
    for n in graph.nodes:
        x, y = where[n.digest]
        kind = "current" if n.level == 0 else ("parent" if n.level < 0 else "child")
        if not n.present:
            kind += " missing"
        if n.hidden:
            kind += " hidden"
        sub = n.digest.short if n.present else f"{n.digest.short} · not in catalog"
        box = (f'<rect x="{x}" y="{y}" width="{_W}" height="{_H}" rx="6"/>'
               f'<text x="{x + 10}" y="{y + 19}" class="name">{escape(_clip(n.label))}</text>'
               f'<text x="{x + 10}" y="{y + 36}" class="digest">{escape(sub)}</text>'
               f"<title>{escape(str(n.digest))}</title>")
        group = f'<g class="node {kind}" data-digest="{escape(str(n.digest))}">{box}</g>'
        if n.present and not n.hidden and n.level != 0:
            group = f'<a href="{escape(href(n.digest))}">{group}</a>'
        out.append(group)
    out.append("</svg>")
    return Markup("".join(out))
