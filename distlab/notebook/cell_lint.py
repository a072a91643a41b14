"""What a cell's text says before it runs: collectives that only some ranks reach.

Every rank of a group must call each of its collectives, in the same order. The commonest bug of
the subject breaks that: a collective in a branch on the rank (``if rank == 0: dist.all_reduce(t)``),
a loop whose count depends on the rank, a rank that leaves a loop or a function early, a send whose
receive is never posted, or every rank sending before it receives. At run time each is a hang, found
at the deadline; in the cell's text it can be seen at once. This reads the cell's syntax tree (no code
runs) and says each in one line with the cell's line and what to do.

What counts as a collective: the calls of ``torch.distributed`` (and of any module under it, under
whatever name the cell imports it) that every rank of a group must make, a model sharded by
``fully_shard`` or ``parallelize_module`` called (its forward all-gathers), and a function defined in
the cell that makes one. A call given a ``group`` is left alone: the branch may be exactly its members.
What does not count: everything else, so rank-0-only printing, logging and saving is never named.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .. import checks
from ..errors import LabUsageError

__all__ = ["CellLinter", "Finding", "lint"]

#: Calls every rank of the group must make (torch.distributed and its submodules' names).
COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object",
    "scatter", "scatter_object_list", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single",
    "new_group", "new_subgroups", "init_device_mesh", "distribute_tensor",
    # torch.distributed.checkpoint: every rank writes or reads its part, and they agree on a plan first.
    "save", "load", "async_save", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
    "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict",
})
SENDS = frozenset({"send", "isend"})
RECEIVES = frozenset({"recv", "irecv"})
#: What makes a model's forward a collective: it is sharded in place by these (its name is the first argument).
SHARDING = frozenset({"fully_shard", "parallelize_module"})
#: Names a distlab rank's namespace binds to the rank (``rank.namespace``), as torchrun's RANK is.
RANK_NAMES = frozenset({"rank", "local_rank"})
RANK_CALLS = frozenset({"get_rank", "get_node_local_rank", "get_local_rank", "get_coordinate"})
RANK_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"})


@dataclass(frozen=True)
class Finding:
    """One thing the cell's text shows: its line in the cell (from 1) and what to do."""

    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass(frozen=True)
class CollectiveCall:
    """A collective the cell makes: its name as written, and its line."""

    name: str
    line: int


def lint(source: str) -> list[Finding]:
    """The collectives of ``source`` (a cell's Python, magics already stripped) that only some ranks
    would reach, each once, in line order. Source that does not parse gives none: running it says why."""
    return CellLinter().check(source)


@dataclass
class CellLinter:
    """Lints a lab's cells in the order they run: a model sharded, or a function that makes a
    collective, in one cell is remembered for the cells after it (the ranks' namespaces keep them)."""

    sharded: set[str] = field(default_factory=set)
    functions: dict[str, list[CollectiveCall]] = field(default_factory=dict)

    def check(self, source: str, remember: bool = True) -> list[Finding]:
        """What :func:`lint` says of ``source``, knowing the cells checked before it; ``remember``:
        what it defines is known to the cells checked after it."""
        found, reader = self._read(source)
        if remember and reader is not None:
            self._remember(reader)
        return found

    def admit(self, source: str, strict: bool) -> None:
        """A cell about to run: refused (nothing runs) where ``strict`` and the lint finds fault with
        it, else remembered, since the ranks will hold what it defines."""
        checks.flag("strict", strict)
        found, reader = self._read(source)
        if strict and found:
            raise LabUsageError(
                f"strict: nothing ran, the lint found {len(found)} collective(s) that only some ranks reach: "
                + "; ".join(map(str, found)) + "; fix the cell, or run it without strict")
        if reader is not None:
            self._remember(reader)

    def _read(self, source: str) -> tuple[list[Finding], _Reader | None]:
        """The findings in line order, and the reader (None where the source does not parse)."""
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return [], None
        reader = _Reader(tree, self.sharded, self.functions)
        found = {(f.line, f.message): f for f in reader.findings()}
        return sorted(found.values(), key=lambda f: f.line), reader

    def _remember(self, reader: _Reader) -> None:
        self.sharded |= reader.sharded
        self.functions.update(reader.functions)

    def forget(self) -> None:
        """A new world (a restart, a stop): its namespaces hold none of the old cells' names."""
        self.sharded.clear()
        self.functions.clear()


class _Reader:
    """One cell's tree: the names it binds to torch.distributed, to the rank and to sharded models,
    and the collectives each of its own functions makes; ``sharded`` and ``functions`` are earlier
    cells' (read, not changed)."""

    def __init__(self, tree: ast.Module, sharded: set[str], functions: dict[str, list[CollectiveCall]]) -> None:
        self.tree = tree
        self.modules = {"dist": "torch.distributed", "torch": "torch"}  # distlab binds dist on every rank
        self.imported: dict[str, str] = {}  # a bare name imported from torch.distributed...: its own name
        self.earlier = functions
        self.sharded: set[str] = set(sharded)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.modules[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full.startswith("torch.distributed"):
                        self.imported[alias.asname or alias.name] = alias.name
                        self.modules[alias.asname or alias.name] = full
            elif (isinstance(node, ast.Call) and self._distributed(node.func) in SHARDING and node.args
                  and isinstance(node.args[0], ast.Name)):
                self.sharded.add(node.args[0].id)
        self.ranked = self._rank_names()
        self.functions = self._functions()

    # -- what a name or an expression is --------------------------------------------------------

    def _distributed(self, func: ast.expr) -> str | None:
        """The name of a torch.distributed function (or its submodules') that ``func`` calls, else None."""
        if isinstance(func, ast.Name):
            return self.imported.get(func.id)
        if isinstance(func, ast.Attribute):
            path = _dotted(func.value)
            if path is None:
                return None
            head, _, rest = path.partition(".")
            full = self.modules.get(head, head) + (f".{rest}" if rest else "")
            return func.attr if full.startswith("torch.distributed") else None
        return None

    def _rank_names(self) -> set[str]:
        """The cell's names whose values follow from the rank (assigned from it, however indirectly)."""
        names = set(RANK_NAMES)
        assignments = [n for n in ast.walk(self.tree) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))]
        changed = True
        while changed:
            changed = False
            for node in assignments:
                value = node.value
                if value is None or not self._on_rank(value, names):
                    continue
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name) and name.id not in names:
                            names.add(name.id)
                            changed = True
        return names

    def _on_rank(self, expr: ast.expr, names: set[str] | None = None) -> bool:
        """Whether ``expr`` is worked out from the rank: a name that holds it, a call that asks for it
        (``dist.get_rank()``, the environment's RANK). An index taken by the rank (``shards[rank]``)
        is the rank's data, not its number, and does not count."""
        names = self.ranked if names is None else names
        return any(self._names_rank(node, names) for node in _outside_subscripts(expr))

    def _names_rank(self, node: ast.AST, names: set[str]) -> bool:
        if isinstance(node, ast.Name):
            return node.id in names
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in RANK_CALLS:
                return True
            if called in ("get", "getenv") and node.args:  # os.environ.get("RANK"), os.getenv("RANK")
                return _constant(node.args[0]) in RANK_VARIABLES
        if isinstance(node, ast.Subscript) and _dotted(node.value) in ("os.environ", "environ"):
            return _constant(node.slice) in RANK_VARIABLES
        return False

    def _functions(self) -> dict[str, list[CollectiveCall]]:
        """The collectives each function defined in the cell makes, its calls of the others included."""
        defined = {n.name: n for n in ast.walk(self.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        own: dict[str, list[CollectiveCall]] = {}
        for _ in range(len(defined) + 1):  # until calls of cell functions are all expanded
            before = {**self.earlier, **own}
            own = {name: [c for stmt in node.body for c in self._calls(stmt, before)] for name, node in defined.items()}
            if own == {name: before.get(name) for name in own}:
                break
        return {**self.earlier, **own}

    def _calls(self, node: ast.AST, functions: dict[str, list[CollectiveCall]] | None = None) -> list[CollectiveCall]:
        """The collectives ``node`` makes, in order (not those of functions it only defines)."""
        functions = self.functions if functions is None else functions
        calls: list[CollectiveCall] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return calls  # defined here, made where it is called
        for sub in _own_nodes(node):
            if not isinstance(sub, ast.Call):
                continue
            name = self._distributed(sub.func)
            if name in COLLECTIVES and not _given_group(sub):
                calls.append(CollectiveCall(f"{_dotted(sub.func) or name}", sub.lineno))
            elif isinstance(sub.func, ast.Name) and sub.func.id in self.sharded:
                calls.append(CollectiveCall(f"{sub.func.id}(...) (sharded: its forward all-gathers)", sub.lineno))
            elif isinstance(sub.func, ast.Name) and sub.func.id in functions:
                inside = f" (in {sub.func.id}())"
                calls.extend(CollectiveCall(c.name + inside, sub.lineno) for c in functions[sub.func.id])
        return sorted(calls, key=lambda c: c.line)

    # -- the checks ------------------------------------------------------------------------------

    def findings(self) -> Iterator[Finding]:
        yield from self._block(self.tree.body)
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from self._block(node.body)
        yield from self._point_to_point()

    def _block(self, body: Sequence[ast.stmt]) -> Iterator[Finding]:
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.If) and self._on_rank(stmt.test):
                yield from self._branch(stmt, body[i + 1:])
            elif isinstance(stmt, (ast.For, ast.AsyncFor)) and self._loop_on_rank(stmt.iter):
                yield from self._loop(stmt, ast.unparse(stmt.iter))
            elif isinstance(stmt, ast.While) and self._on_rank(stmt.test):
                yield from self._loop(stmt, ast.unparse(stmt.test))
            for child in _child_blocks(stmt):
                yield from self._block(child)

    def _branch(self, stmt: ast.If, after: Sequence[ast.stmt]) -> Iterator[Finding]:
        test = ast.unparse(stmt.test)
        taken = [c for s in stmt.body for c in self._calls(s)]
        other = [c for s in stmt.orelse for c in self._calls(s)]
        if [c.name for c in taken] != [c.name for c in other]:
            odd, where = _first_difference(taken, other)
            side = f"where {test!r} is {'true' if where == 'taken' else 'false'}"
            yield Finding(odd.line, f"{odd.name} is called only {side} (line {stmt.lineno}): every rank of its "
                                    "group must call it, in the same order; call it on every rank, outside the branch")
        # A branch that leaves (return, continue, break) leaves the rest of the block to the other ranks.
        for leaving, side in ((stmt.body, "true"), (stmt.orelse, "false")):
            if leaving and isinstance(leaving[-1], (ast.Return, ast.Continue, ast.Break)):
                rest = [c for s in after for c in self._calls(s)]
                if rest:
                    exit_word = type(leaving[-1]).__name__.lower()
                    yield Finding(rest[0].line, f"{rest[0].name} is not reached by the ranks where {test!r} is "
                                                f"{side}: they {exit_word} at line {leaving[-1].lineno}; every rank "
                                                "of its group must call it: let them all reach it")

    def _loop(self, stmt: ast.For | ast.AsyncFor | ast.While, bound: str) -> Iterator[Finding]:
        calls = [c for s in stmt.body for c in self._calls(s)]
        if calls:
            yield Finding(calls[0].line, f"{calls[0].name} is in a loop whose count depends on the rank (line "
                                         f"{stmt.lineno}: {bound}): ranks call it a different number of times and "
                                         "the extra calls wait forever; give every rank the same count")

    def _loop_on_rank(self, iterable: ast.expr) -> bool:
        """A loop's count follows the rank: ``range(...)`` of anything worked out from it (an index by
        the rank included: ``range(counts[rank])``), or an iterable that is itself the rank's."""
        if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name) and iterable.func.id == "range":
            return any(isinstance(n, ast.Name) and n.id in self.ranked for a in iterable.args for n in ast.walk(a))
        return self._on_rank(iterable)

    def _point_to_point(self) -> Iterator[Finding]:
        """Sends and receives: one kind without the other in the cell, or every rank sending first."""
        sends, receives = self._p2p(SENDS), self._p2p(RECEIVES)
        if sends and not receives:
            yield Finding(sends[0][0], f"{sends[0][1]} has no recv or irecv anywhere in the cell: the rank it "
                                       "sends to must post one, or the send waits")
        if receives and not sends:
            yield Finding(receives[0][0], f"{receives[0][1]} has no send or isend anywhere in the cell: "
                                          "the rank it receives from must post one, or the receive waits")
        yield from self._send_first(self.tree.body, False)

    def _p2p(self, kinds: frozenset[str]) -> list[tuple[int, str]]:
        found = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and self._distributed(node.func) in kinds:
                found.append((node.lineno, _dotted(node.func) or "send"))
            # dist.P2POp(dist.isend, ...): the op is named, not called
            elif (isinstance(node, ast.Call) and self._distributed(node.func) == "P2POp" and node.args
                  and self._distributed(node.args[0]) in kinds):
                found.append((node.lineno, _dotted(node.args[0]) or "isend"))
        return sorted(found)

    def _send_first(self, body: Sequence[ast.stmt], branched: bool) -> Iterator[Finding]:
        """Blocking send before blocking recv in code every rank runs: each waits in its send."""
        if not branched:
            order = [(s.lineno, self._distributed(c.func)) for s in body if isinstance(s, ast.Expr)
                     for c in [s.value] if isinstance(c, ast.Call) and self._distributed(c.func) in ("send", "recv")]
            if order and order[0][1] == "send" and any(kind == "recv" for _, kind in order):
                first_recv = next(line for line, kind in order if kind == "recv")
                yield Finding(order[0][0], f"every rank sends (line {order[0][0]}) before it receives (line "
                                           f"{first_recv}): a blocking send waits for its receive, so every rank "
                                           "waits; let even ranks send first and odd ranks receive first, or post "
                                           "both at once with dist.batch_isend_irecv")
        for stmt in body:
            on_rank = isinstance(stmt, ast.If) and self._on_rank(stmt.test)
            for child in _child_blocks(stmt):
                yield from self._send_first(child, branched or on_rank)


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of names, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def _constant(node: ast.expr) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def _given_group(call: ast.Call) -> bool:
    """Whether a collective is given its group (by keyword, or a DeviceMesh's dimension): the ranks of a
    branch may be exactly its members."""
    return any(k.arg in ("group", "process_group", "pg", "mesh", "device_mesh") for k in call.keywords)


def _outside_subscripts(expr: ast.expr) -> Iterator[ast.AST]:
    """The nodes of ``expr``, not descending into what a subscript is indexed by."""
    yield expr
    if isinstance(expr, ast.Subscript):
        yield from _outside_subscripts(expr.value)
        return
    for child in ast.iter_child_nodes(expr):
        if isinstance(child, ast.expr):
            yield from _outside_subscripts(child)
        else:
            yield child


def _own_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``node``, not descending into the functions, lambdas and classes it defines."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield from _own_nodes(child)


def _child_blocks(stmt: ast.stmt) -> Iterator[list[ast.stmt]]:
    """The statement lists inside a compound statement (not a function's or a class's own body)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return
    for name in ("body", "orelse", "finalbody"):
        block = getattr(stmt, name, None)
        if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
            yield block
    for handler in getattr(stmt, "handlers", []):
        yield handler.body
    for case in getattr(stmt, "cases", []):
        yield case.body


def _first_difference(taken: list[CollectiveCall], other: list[CollectiveCall]) -> tuple[CollectiveCall, str]:
    """The first call where the two branches' sequences part, and which branch makes it."""
    for i, call in enumerate(taken):
        if i >= len(other) or other[i].name != call.name:
            return call, "taken"
    return other[len(taken)], "other"
