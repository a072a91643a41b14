"""Where a `%%ddp` cell's code would leave a tensor or a model on the CPU on a GPU rank.

On CPU ranks `device` is the CPU and any code runs; on GPU ranks NCCL takes only CUDA tensors and a
model on the CPU cannot take a batch on the GPU. So a cell meant for both says where each tensor and
model goes. This reads a cell's code (never runs it) and names each place that does not:

- a tensor made by a torch factory (``torch.randn``, ``torch.zeros``, ``torch.tensor``, ...) with no
  ``device=`` and not moved at once (``.to(...)``, ``.cuda()``);
- a model made (a ``torch.nn`` layer with parameters, a class of the notebook that subclasses
  ``nn.Module``, or a function of the notebook that returns one) and not moved at once, outside
  another model's construction;
- ``.numpy()`` on a tensor not brought to the CPU first (``.cpu().numpy()``);
- the CPU named where the rank's device belongs (``init_device_mesh("cpu", ...)``, ``device="cpu"``,
  ``torch.device("cpu")``).

A line meant to stay on the CPU says so in a comment naming the CPU (``# indices: CPU, as X is``):
the comment is the reason a reader needs, and the check accepts it. Code that moves data later (a
CPU batch from a pushed function, moved by ``.to(device)`` lines after) is not followed: this is a
reading, and the run on GPU ranks is the proof.
"""

from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass

FACTORIES = frozenset({
    "randn", "rand", "randint", "zeros", "ones", "empty", "full", "arange", "tensor", "linspace",
    "logspace", "eye", "normal", "randperm", "as_tensor",
})
# torch.nn modules that hold parameters or buffers (activations, losses and dropout hold none).
LAYERS = frozenset({
    "Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "Embedding",
    "EmbeddingBag", "LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
    "InstanceNorm2d", "Sequential", "ModuleList", "ModuleDict", "LSTM", "GRU", "RNN", "MultiheadAttention",
    "TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder", "Transformer", "Parameter",
})
MOVES = frozenset({"to", "cuda", "to_empty"})
# Models distlab ships (distlab.nn), made in cells by name.
SHIPPED_MAKERS = frozenset({"GPT"})


@dataclass(frozen=True)
class Finding:
    line: int  # 1-based, within the cell's code
    text: str  # the line
    why: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.why}: {self.text.strip()}"


def _dotted(node: ast.AST) -> str:
    """'torch.nn.Linear' for that attribute chain; '' for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _is_layer(call: ast.Call) -> bool:
    name = _dotted(call.func)
    head, _, last = name.rpartition(".")
    return last in LAYERS and head in ("nn", "torch.nn")


def _code(source: str) -> str:
    """The Python of a cell: cell and line magics blanked, so that line numbers stay."""
    return "\n".join("" if line.lstrip().startswith("%") else line for line in source.splitlines())


def model_makers(sources: list[str]) -> set[str]:
    """Names that make a model: the notebook's nn.Module classes and functions that return a model."""
    trees = []
    for source in sources:
        try:
            trees.append(ast.parse(_code(source)))
        except SyntaxError:
            continue
    makers: set[str] = set(SHIPPED_MAKERS)
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(_dotted(b).endswith("Module") for b in node.bases):
                makers.add(node.name)
    changed = True
    while changed:  # a function returning another maker's model is one too
        changed = False
        for tree in trees:
            for node in ast.walk(tree):
                if not isinstance(node, ast.FunctionDef) or node.name in makers:
                    continue
                returns = [r.value for r in ast.walk(node) if isinstance(r, ast.Return) and r.value is not None]
                if any(_makes_model(value, makers) for value in returns):
                    makers.add(node.name)
                    changed = True
    return makers


def _makes_model(node: ast.AST, makers: set[str]) -> bool:
    return isinstance(node, ast.Call) and (_is_layer(node) or _dotted(node.func) in makers)


def _cpu_comments(code: str) -> set[int]:
    lines = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.COMMENT and "CPU" in tok.string:
                lines.add(tok.start[0])
    except (tokenize.TokenError, IndentationError):
        pass
    return lines


def findings(source: str, makers: set[str] | frozenset[str] = SHIPPED_MAKERS) -> list[Finding]:
    """Each place in one `%%ddp` cell's code that leaves a tensor or model on the CPU."""
    code = _code(source)
    tree = ast.parse(code)
    lines = code.splitlines()
    excused = _cpu_comments(code)
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node

    def moved(call: ast.Call) -> bool:
        """Has ``device=``, or is the receiver of ``.to(...)`` / ``.cuda()`` at once."""
        if any(k.arg == "device" for k in call.keywords):
            return True
        up = parents.get(call)
        return isinstance(up, ast.Attribute) and up.attr in MOVES and isinstance(parents.get(up), ast.Call)

    def inside_model(call: ast.Call) -> bool:
        """Part of another model: an argument of its construction, or in the body of a class or
        function that makes one (the model is moved where it is made, which is checked there)."""
        node = parents.get(call)
        in_statement = True
        while node is not None:
            if in_statement and isinstance(node, ast.Call) and _makes_model(node, makers):
                return True
            if isinstance(node, ast.stmt):
                in_statement = False
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in makers:
                return True
            node = parents.get(node)
        return False

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        line = node.lineno
        if line in excused:
            continue
        name = _dotted(node.func)
        why = ""
        if name.startswith("torch.") and name.count(".") == 1 and name.split(".")[1] in FACTORIES:
            if not moved(node):
                why = f"{name}(...) makes a CPU tensor: pass device=device"
        elif _makes_model(node, makers) and not inside_model(node) and not moved(node):
            why = f"{name}(...) makes a model on the CPU: add .to(device)"
        elif isinstance(node.func, ast.Attribute) and node.func.attr == "numpy":
            receiver = node.func.value
            on_cpu = isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Attribute)
            if not (on_cpu and receiver.func.attr == "cpu"):
                why = ".numpy() fails on a CUDA tensor: call .cpu().numpy()"
        cpu = [a for a in [*node.args[:1], *(k.value for k in node.keywords if k.arg in ("device", "device_type"))]
               if isinstance(a, ast.Constant) and a.value == "cpu"]
        named = (
            name.endswith("init_device_mesh") or name == "torch.device" or any(k.arg == "device" for k in node.keywords)
        )
        if not why and cpu and named:
            why = f'{name or "a call"}(..."cpu"...) names the CPU: use device.type or device'
        if why:
            found.append(Finding(line, lines[line - 1], why))
    return sorted(found, key=lambda f: f.line)
