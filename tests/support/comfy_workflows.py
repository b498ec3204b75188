"""Static checks of ComfyUI workflows (UI "graph" format and API "prompt" format) against a
server's ``/object_info``, and the UI-to-API mapping the frontend performs, for tier-2 tests.

Facts these rely on, true of ComfyUI 0.3.64 and 0.8.0 and their frontends:
- ``/object_info`` gives each node's inputs as ``[type, options]``; a combo's type is either the
  list of its values (classic nodes) or ``"COMBO"`` with ``options["options"]`` (V3 nodes);
  ``input_order`` gives the order in which the frontend creates widgets.
- A UI node's ``widgets_values`` hold one value per widget input, in that order, plus one more
  right after each input flagged ``control_after_generate`` (the "fixed"/"randomize" control).
- A link is ``[id, origin node, origin slot, target node, target slot, type]``.
"""
from __future__ import annotations

import math

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
# Nodes that live only in the frontend: they have no /object_info entry and never reach /prompt.
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
# Model files are the user's: an example names the usual file, which this server need not have.
MODEL_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".gguf", ".sft")
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}


def input_specs(info: dict) -> dict[str, list]:
    specs = {}
    for group in ("required", "optional"):
        specs.update(info.get("input", {}).get(group, {}))
    return specs


def input_order(info: dict) -> list[str]:
    order = info.get("input_order")
    if order:
        return list(order.get("required", [])) + list(order.get("optional", []))
    return list(input_specs(info))


def input_type(spec: list) -> str:
    return "COMBO" if isinstance(spec[0], list) else spec[0]


def input_options(spec: list) -> dict:
    return spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}


def combo_values(spec: list) -> list:
    return spec[0] if isinstance(spec[0], list) else input_options(spec).get("options", [])


def is_widget(spec: list) -> bool:
    return input_type(spec) in WIDGET_TYPES and not input_options(spec).get("forceInput")


def widget_names(info: dict) -> list[str]:
    specs = input_specs(info)
    return [name for name in input_order(info) if is_widget(specs[name])]


def types_match(out_type: str, in_type: str) -> bool:
    if "*" in (out_type, in_type):
        return True
    return bool(set(out_type.split(",")) & set(in_type.split(",")))


def value_problem(name: str, spec: list, value) -> str | None:
    """Why ``value`` is not acceptable for widget input ``name``, or None."""
    kind, opts = input_type(spec), input_options(spec)
    if kind == "COMBO":
        if isinstance(value, str) and value.lower().endswith(MODEL_SUFFIXES):
            return None
        values = combo_values(spec)
        return None if value in values else f"{name}={value!r} is not one of {values[:20]}"
    if kind == "BOOLEAN":
        return None if isinstance(value, bool) else f"{name}={value!r} is not a boolean"
    if kind == "STRING":
        return None if isinstance(value, str) else f"{name}={value!r} is not a string"
    if kind in ("INT", "FLOAT"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (kind == "INT" and not float(value).is_integer()) or not math.isfinite(value):
            return f"{name}={value!r} is not a {kind}"
        low, high = opts.get("min", -math.inf), opts.get("max", math.inf)
        return None if low <= value <= high else f"{name}={value!r} outside [{low}, {high}]"
    return None


def check_api_prompt(prompt: dict, object_info: dict) -> list[str]:
    problems = []
    for node_id, node in prompt.items():
        where = f"API node {node_id} ({node.get('class_type')})"
        info = object_info.get(node.get("class_type"))
        if info is None:
            problems.append(f"{where}: unknown node type")
            continue
        specs = input_specs(info)
        inputs = node.get("inputs", {})
        for name in info.get("input", {}).get("required", {}):
            if name not in inputs:
                problems.append(f"{where}: required input {name!r} missing")
        for name, value in inputs.items():
            spec = specs.get(name)
            if spec is None:
                problems.append(f"{where}: unknown input {name!r}")
            elif isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                problems += [f"{where}: {p}" for p in link_problems(prompt, object_info, value, name, spec)]
            elif not is_widget(spec):
                problems.append(f"{where}: socket input {name!r} given a value, not a link")
            else:
                problem = value_problem(name, spec, value)
                if problem:
                    problems.append(f"{where}: {problem}")
    return problems


def link_problems(prompt: dict, object_info: dict, link: list, name: str, spec: list) -> list[str]:
    origin_id, slot = link
    origin = prompt.get(origin_id)
    if origin is None:
        return [f"input {name!r} links to missing node {origin_id}"]
    outputs = object_info.get(origin.get("class_type"), {}).get("output", [])
    if not isinstance(slot, int) or not 0 <= slot < len(outputs):
        return [f"input {name!r} links to output {slot} of {origin['class_type']}, which has {len(outputs)}"]
    if not types_match(outputs[slot], input_type(spec)):
        return [f"input {name!r} ({input_type(spec)}) linked to a {outputs[slot]} output"]
    return []


def widget_values_by_name(node: dict, info: dict) -> tuple[dict, list[str]]:
    """The UI node's widget values by input name, and problems with their count."""
    values = list(node.get("widgets_values") or [])
    specs = input_specs(info)
    named, problems, i = {}, [], 0
    for name in widget_names(info):
        if i >= len(values):
            problems.append(f"no widget value for {name!r}")
            break
        named[name] = values[i]
        i += 1
        if input_options(specs[name]).get("control_after_generate"):
            if i < len(values) and values[i] in CONTROL_VALUES:
                i += 1
            else:
                problems.append(f"{name!r} needs a control value (fixed/randomize/...) after it")
    if i < len(values):
        problems.append(f"{len(values) - i} widget values more than the node has widgets")
    return named, problems


def check_ui_workflow(workflow: dict, object_info: dict) -> list[str]:
    problems = []
    nodes = {n["id"]: n for n in workflow.get("nodes", [])}
    links = {link[0]: link for link in workflow.get("links", [])}
    for node in nodes.values():
        where = f"UI node {node['id']} ({node['type']})"
        if node["type"] in FRONTEND_ONLY:
            continue
        info = object_info.get(node["type"])
        if info is None:
            problems.append(f"{where}: unknown node type")
            continue
        specs = input_specs(info)
        named, count_problems = widget_values_by_name(node, info)
        problems += [f"{where}: {p}" for p in count_problems]
        for name, value in named.items():
            problem = value_problem(name, specs[name], value)
            if problem:
                problems.append(f"{where}: {problem}")
        for slot in node.get("inputs") or []:
            if slot["name"] not in specs:
                problems.append(f"{where}: unknown input {slot['name']!r}")
            elif slot.get("link") is not None and slot["link"] not in links:
                problems.append(f"{where}: input {slot['name']!r} names missing link {slot['link']}")
        linked = {s["name"] for s in node.get("inputs") or [] if s.get("link") is not None}
        for name in info.get("input", {}).get("required", {}):
            if not is_widget(specs[name]) and name not in linked:
                problems.append(f"{where}: required input {name!r} is not connected")
    for link_id, origin_id, origin_slot, target_id, target_slot, link_type in links.values():
        where = f"link {link_id}"
        origin, target = nodes.get(origin_id), nodes.get(target_id)
        if origin is None or target is None:
            problems.append(f"{where}: joins missing node {origin_id} or {target_id}")
            continue
        outputs = origin.get("outputs") or []
        inputs = target.get("inputs") or []
        if origin_slot >= len(outputs) or target_slot >= len(inputs):
            problems.append(f"{where}: slot out of range")
            continue
        out_slot, in_slot = outputs[origin_slot], inputs[target_slot]
        if link_id not in (out_slot.get("links") or []) or in_slot.get("link") != link_id:
            problems.append(f"{where}: not listed on both of its slots")
        origin_info = object_info.get(origin["type"])
        target_info = object_info.get(target["type"])
        if origin_info is not None:
            declared = origin_info["output"][origin_slot]
            if declared != link_type or out_slot["type"] != declared:
                problems.append(f"{where}: carries {link_type} from a {declared} output")
        if target_info is not None and in_slot["name"] in input_specs(target_info):
            wanted = input_type(input_specs(target_info)[in_slot["name"]])
            if not types_match(link_type, wanted):
                problems.append(f"{where}: {link_type} into {target['type']}.{in_slot['name']} ({wanted})")
    return problems


def ui_to_api(workflow: dict, object_info: dict) -> dict:
    """The API prompt the frontend makes from a UI workflow (without its ``_meta`` titles)."""
    nodes = {n["id"]: n for n in workflow.get("nodes", [])}
    links = {link[0]: link for link in workflow.get("links", [])}
    prompt = {}
    for node in nodes.values():
        if node["type"] in FRONTEND_ONLY or node.get("mode", 0) in (2, 4):  # muted / bypassed
            continue
        info = object_info[node["type"]]
        inputs, _ = widget_values_by_name(node, info)
        for slot in node.get("inputs") or []:
            if slot.get("link") is not None:
                _, origin_id, origin_slot, *_ = links[slot["link"]]
                inputs[slot["name"]] = [str(origin_id), origin_slot]
        prompt[str(node["id"])] = {"inputs": inputs, "class_type": node["type"]}
    return prompt


def without_meta(prompt: dict) -> dict:
    return {k: {"inputs": v["inputs"], "class_type": v["class_type"]} for k, v in prompt.items()}
