"""BFCL v4 multi-turn examples as OpenAI-format traces, with tool results from real execution.

Data comes from the ``bfcl-eval`` package (``pip install --no-deps bfcl-eval``), located with
``importlib.util.find_spec`` and read as files:

- questions: ``bfcl_eval/data/BFCL_v4_<category>.json`` (one user-message list per turn),
- ground truth: ``bfcl_eval/data/possible_answer/BFCL_v4_<category>.json`` (python-call
  strings such as ``"cd(folder='document')"`` per turn),
- function docs: ``bfcl_eval/data/multi_turn_func_doc/<class file>.json``,
- simulators: ``bfcl_eval/eval_checker/multi_turn_eval/func_source_code/*.py``.

Each turn becomes: the user message(s); per ground-truth call an assistant message with one
``tool_calls`` entry and a ``tool`` message holding the result of executing that call on the
simulator instances (``_load_scenario(initial_config[cls])``, exactly as BFCL's checker does,
but calls are parsed with :mod:`ast` and dispatched to methods, never ``eval``-ed); then a
short assistant message closing the turn. Missed-function turns (``multi_turn_miss_func``)
get BFCL's "I have updated some more functions" user prompt; the trace's ``tools`` list
holds every function of the involved classes, the held-out ones included.

Classes whose simulator module needs a missing package are reported with a warning and the
examples that involve them are skipped.
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.util
import inspect
import json
import warnings
from functools import cache
from pathlib import Path
from typing import Any

from agentkv.bench.traces import Trace, sample_ids

CATEGORIES = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)
#: BFCL's DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC.
ADDED_FUNCTIONS_PROMPT = "I have updated some more functions you can choose from. What about now?"
NO_CALL_REPLY = "I can't complete that with the functions and details I have. Could you help?"
_RESULT_CHARS_IN_REPLY = 200

_SIMULATOR_PACKAGE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
#: BFCL class -> (simulator module, function-doc file); mirrors
#: bfcl_eval.constants.executable_backend_config for the multi-turn classes.
CLASSES: dict[str, tuple[str, str]] = {
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}
STATELESS_CLASSES = {"MathAPI"}

#: Gorilla parameter types -> JSON Schema types (BFCL's GORILLA_TO_OPENAPI).
_TYPES = {
    "integer": "integer",
    "number": "number",
    "float": "number",
    "string": "string",
    "boolean": "boolean",
    "bool": "boolean",
    "array": "array",
    "list": "array",
    "tuple": "array",
    "dict": "object",
    "object": "object",
    "any": "string",
}


class BFCLUnavailable(RuntimeError):
    """bfcl-eval is not installed (or lacks its data files)."""


def bfcl_root() -> Path:
    """The installed ``bfcl_eval`` package folder (not imported)."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise BFCLUnavailable(
            "BFCL traces need the bfcl-eval package: pip install --no-deps bfcl-eval==2026.3.23"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _data_file(folder: Path, category: str) -> Path:
    found = sorted(folder.glob(f"BFCL_v*_{category}.json"))
    if not found:
        raise BFCLUnavailable(f"no BFCL file for category {category!r} under {folder}")
    return found[-1]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------- tool schemas


def _param_schema(p: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    kind = _TYPES.get(str(p.get("type", "string")), "string")
    out["type"] = kind
    if p.get("description"):
        out["description"] = p["description"]
    for key in ("enum", "default"):
        if key in p:
            out[key] = p[key]
    if kind == "array" and isinstance(p.get("items"), dict):
        out["items"] = _param_schema(p["items"])
    if kind == "object" and isinstance(p.get("properties"), dict):
        out["properties"] = {k: _param_schema(v) for k, v in p["properties"].items()}
        if p.get("required"):
            out["required"] = list(p["required"])
    return out


def openai_tool(doc: dict[str, Any]) -> dict[str, Any]:
    """A BFCL function doc as an OpenAI tool schema."""
    params = doc.get("parameters") or {}
    return {
        "type": "function",
        "function": {
            "name": doc["name"],
            "description": doc.get("description", ""),
            "parameters": {
                "type": "object",
                "properties": {
                    k: _param_schema(v) for k, v in (params.get("properties") or {}).items()
                },
                "required": list(params.get("required") or []),
            },
        },
    }


@cache
def _func_docs(class_name: str) -> tuple[dict[str, Any], ...]:
    path = bfcl_root() / "data" / "multi_turn_func_doc" / CLASSES[class_name][1]
    return tuple(_read_jsonl(path))


# --------------------------------------------------------------------------- execution


def parse_call(text: str) -> tuple[str, list[Any], dict[str, Any]]:
    """``"mv(source='a', destination='b')"`` -> ``("mv", [], {"source": "a", ...})``.

    Only a plain call of a bare name with literal arguments is accepted (``ast``, no eval).
    """
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"not a python call: {text!r} ({e.msg})") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"expected a call like name(arg=...), got {text!r}")
    try:
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except ValueError:
        raise ValueError(f"call arguments must be literals: {text!r}") from None
    if any(kw.arg is None for kw in node.keywords):
        raise ValueError(f"**kwargs are not allowed: {text!r}")
    return node.func.id, args, kwargs


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def _result_text(result: Any) -> str:
    """A result as BFCL's checker renders it: str as is, dict as JSON, else ``str``."""
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


@cache
def _simulator_class(class_name: str) -> type:
    module = importlib.import_module(f"{_SIMULATOR_PACKAGE}.{CLASSES[class_name][0]}")
    return getattr(module, class_name)


class Simulators:
    """The simulator instances of one BFCL example, methods dispatched by name."""

    def __init__(self, involved: list[str], initial_config: dict[str, Any], long_context: bool):
        self.instances: dict[str, Any] = {}
        self.methods: dict[str, Any] = {}
        for name in involved:
            instance = _simulator_class(name)()
            if name not in STATELESS_CLASSES:
                config = copy.deepcopy(initial_config.get(name, {}))
                instance._load_scenario(config, long_context=long_context)
            self.instances[name] = instance
            for method_name, method in inspect.getmembers(instance, inspect.ismethod):
                if not method_name.startswith("_"):
                    self.methods[method_name] = method

    def call(
        self, name: str, args: list[Any], kwargs: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        """Run one call; returns (arguments by name, result text)."""
        method = self.methods.get(name)
        if method is None:
            return kwargs, f"Error during execution: no function named {name!r}"
        try:
            bound = inspect.signature(method).bind(*args, **kwargs)
        except TypeError as e:
            return kwargs, f"Error during execution: {e}"
        arguments = dict(bound.arguments)
        try:
            result = method(*bound.args, **bound.kwargs)
        except Exception as e:  # the simulator's own errors are part of the trace
            return arguments, f"Error during execution: {e}"
        return arguments, _result_text(result)


# --------------------------------------------------------------------------- traces


def _available_classes(classes: set[str]) -> set[str]:
    ok = set()
    for name in sorted(classes):
        if name not in CLASSES:
            warnings.warn(f"BFCL class {name!r} has no simulator mapping; skipping", stacklevel=3)
            continue
        try:
            _simulator_class(name)
        except ModuleNotFoundError as e:
            warnings.warn(
                f"BFCL simulator {name} needs the missing package {e.name!r}; "
                "skipping examples that involve it",
                stacklevel=3,
            )
            continue
        ok.add(name)
    return ok


def build_trace(entry: dict[str, Any], answer: dict[str, Any], category: str) -> Trace:
    """One BFCL example (question entry + possible answer) as an executed trace."""
    involved = list(entry["involved_classes"])
    sims = Simulators(involved, entry.get("initial_config") or {}, "long_context" in category)
    missed = {int(k): list(v) for k, v in (entry.get("missed_function") or {}).items()}
    tools = [openai_tool(doc) for name in involved for doc in _func_docs(name)]
    questions, truth = entry["question"], answer["ground_truth"]
    if len(questions) != len(truth):
        raise ValueError(f"{entry['id']}: {len(questions)} turns but {len(truth)} answers")
    messages: list[dict[str, Any]] = []
    for turn, (asked, calls) in enumerate(zip(questions, truth, strict=True)):
        users = [{"role": m["role"], "content": m["content"]} for m in asked]
        if not users:
            users = [{"role": "user", "content": ADDED_FUNCTIONS_PROMPT if turn in missed else ""}]
        messages += users
        last = None
        for k, text in enumerate(calls):
            name, args, kwargs = parse_call(text)
            arguments, last = sims.call(name, args, kwargs)
            call_id = f"call_{turn}_{k}"
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {
                                "name": name,
                                "arguments": json.dumps(_jsonable(arguments)),
                            },
                        }
                    ],
                }
            )
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "name": name, "content": last}
            )
        if last is None:
            reply = NO_CALL_REPLY
        elif len(last) <= _RESULT_CHARS_IN_REPLY:
            reply = f"Done. Result: {last}"
        else:
            reply = f"Done. Result: {last[:_RESULT_CHARS_IN_REPLY]}..."
        messages.append({"role": "assistant", "content": reply})
    return Trace(
        id=entry["id"],
        source="bfcl",
        messages=messages,
        tools=tools,
        meta={
            "category": category,
            "involved_classes": involved,
            "missed_function": {str(k): v for k, v in missed.items()},
            "num_turns": len(questions),
        },
    )


def load_bfcl(
    category: str = "multi_turn_base", limit: int | None = None, seed: int = 0
) -> list[Trace]:
    """BFCL multi-turn examples of one category as traces (``limit``: seeded sample by id)."""
    if not category.startswith("multi_turn_"):
        category = f"multi_turn_{category}"
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; expected one of {list(CATEGORIES)}")
    root = bfcl_root() / "data"
    entries = {e["id"]: e for e in _read_jsonl(_data_file(root, category))}
    answers = {a["id"]: a for a in _read_jsonl(_data_file(root / "possible_answer", category))}
    missing = sorted(set(entries) - set(answers))
    if missing:
        raise BFCLUnavailable(f"BFCL {category}: no ground truth for {missing[:5]}")
    usable = _available_classes({c for e in entries.values() for c in e["involved_classes"]})
    ids = [i for i, e in entries.items() if set(e["involved_classes"]) <= usable]
    return [build_trace(entries[i], answers[i], category) for i in sample_ids(ids, limit, seed)]
