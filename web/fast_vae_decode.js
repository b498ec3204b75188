// Fast VAE Decode: after a FastVAEDecode node runs, draw which path ran and how long it took
// under its widgets; a setting gives the quality of newly created nodes.
//
// Contract with the server (nodes/fast_vae_decode.py): the node's ui output is
//   { text: [outcome text], fast_vae_decode: [{ path, quality, fused, ms, reason, text }] }
// and the frontend hands that object to node.onExecuted.
//
// Works with the classic canvas of frontends 1.27 (ComfyUI 0.3.64) and 1.35 (0.8.0) and with
// 1.35's Vue nodes: the status is a custom widget with draw()/computeSize(), which the canvas
// draws itself and Vue nodes render through their canvas fallback for custom widget types.
import { app } from "../../scripts/app.js";

const NODE_ID = "FastVAEDecode";
const SETTING_ID = "FastVAEDecode.DefaultQuality";
const QUALITIES = ["high", "lossless"];
const STATUS_WIDGET = "fast_vae_decode_status";
const STATUS_HEIGHT = 20;
const MARGIN = 15;
// Mid-lightness hues read on the dark and the light palettes alike; lossless uses the palette's.
const COLORS = { high: "#4caf50", fallback: "#d08a1c" };

function formatMs(ms) {
  const n = Number(ms);
  if (!Number.isFinite(n)) return null;
  return n < 10 ? `${n.toFixed(1)} ms` : `${Math.round(n)} ms`;
}

// One short line from the node's ui output, e.g. "high · 23 ms · 38 fused", "lossless · 80 ms",
// "fallback: no Triton · 80 ms". Unknown shapes degrade to the server's own text; the server's
// full text (with any per-call stock fallbacks) becomes the widget's tooltip.
export function statusFromOutput(output) {
  const serverText = Array.isArray(output?.text) ? output.text[0] : undefined;
  const info = Array.isArray(output?.fast_vae_decode) ? output.fast_vae_decode[0] : undefined;
  if (!info || typeof info !== "object") {
    return serverText == null ? null : { path: "", text: String(serverText), detail: "" };
  }
  const path = String(info.path ?? info.quality ?? "");
  const ms = formatMs(info.ms);
  let parts;
  if (path === "high") {
    parts = ["high", ms, Number.isFinite(Number(info.fused)) ? `${info.fused} fused` : null];
  } else if (path === "fallback") {
    parts = [`fallback: ${info.reason || "stock path"}`, ms];
  } else {
    parts = [path || "lossless", ms];
  }
  return {
    path,
    text: parts.filter(Boolean).join(" · "),
    detail: String(info.text ?? serverText ?? ""),
  };
}

function fitText(ctx, text, width) {
  if (ctx.measureText(text).width <= width) return text;
  let lo = 0;
  let hi = text.length;
  while (lo < hi) {
    const mid = (lo + hi + 1) >> 1;
    if (ctx.measureText(text.slice(0, mid) + "…").width <= width) lo = mid;
    else hi = mid - 1;
  }
  return text.slice(0, lo) + "…";
}

function textColor(path) {
  const lg = globalThis.LiteGraph;
  return COLORS[path] ?? lg?.WIDGET_SECONDARY_TEXT_COLOR ?? lg?.WIDGET_TEXT_COLOR ?? "#bbb";
}

// Not serialized: neither into the workflow's widgets_values (serialize) nor into the API
// prompt (options.serialize), so saved workflows and /prompt inputs stay exactly as before.
function makeStatusWidget() {
  return {
    name: STATUS_WIDGET,
    type: STATUS_WIDGET,
    value: "",
    path: "",
    serialize: false,
    options: { serialize: false },
    computeSize(width) {
      return [width ?? 0, STATUS_HEIGHT];
    },
    draw(ctx, node, width, y, _height, lowQuality) {
      if (!this.value || lowQuality) return;
      ctx.save();
      ctx.font = "12px Arial, sans-serif";
      ctx.textAlign = "left";
      ctx.textBaseline = "middle";
      ctx.fillStyle = textColor(this.path);
      const w = Math.max(0, (width ?? node?.size?.[0] ?? 0) - 2 * MARGIN);
      ctx.fillText(fitText(ctx, this.value, w), MARGIN, y + STATUS_HEIGHT / 2);
      ctx.restore();
    },
  };
}

function statusWidget(node) {
  const existing = node.widgets?.find((w) => w.name === STATUS_WIDGET);
  if (existing) return existing;
  const widget = node.addCustomWidget(makeStatusWidget());
  const [w, h] = node.computeSize();
  node.setSize?.([Math.max(node.size[0], w), Math.max(node.size[1], h)]);
  return widget;
}

export function showStatus(node, output) {
  const status = statusFromOutput(output);
  if (!status) return;
  const widget = statusWidget(node);
  widget.value = status.text;
  widget.path = status.path;
  widget.tooltip = status.detail || status.text;
  widget.triggerDraw?.(); // Vue nodes redraw their canvas fallback only when asked
  node.setDirtyCanvas?.(true, false);
}

function settingValue(id) {
  try {
    const store = app.extensionManager?.setting;
    if (store?.get) return store.get(id);
    return app.ui?.settings?.getSettingValue?.(id);
  } catch {
    return undefined;
  }
}

app.registerExtension({
  name: "FastVAEDecode.Status",
  settings: [
    {
      id: SETTING_ID,
      category: ["Fast VAE Decode", "Nodes", "Default quality"],
      name: "Default quality of new Fast VAE Decode nodes",
      tooltip:
        "high: fused kernels, visually identical. lossless: bit-exact with VAE Decode. " +
        "Workflows you load keep the quality they were saved with.",
      type: "combo",
      options: QUALITIES,
      defaultValue: "high",
    },
  ],

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== NODE_ID) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      const result = onExecuted?.apply(this, arguments);
      try {
        showStatus(this, output);
      } catch (error) {
        console.warn("[Fast VAE Decode] could not show the decode status", error);
      }
      return result;
    };
  },

  // Switching back to a workflow tab (or opening a finished job) rebuilds its nodes and then
  // hands the outputs it kept to this hook instead of onExecuted.
  onNodeOutputsUpdated(outputs) {
    for (const [id, output] of Object.entries(outputs ?? {})) {
      const node = app.graph?.getNodeById?.(id);
      if (node?.comfyClass !== NODE_ID || !output?.fast_vae_decode) continue;
      try {
        showStatus(node, output);
      } catch (error) {
        console.warn("[Fast VAE Decode] could not restore the decode status", error);
      }
    }
  },

  // Runs synchronously inside the node's constructor, before a loaded or pasted node's
  // configure() restores its saved widgets_values, so saved workflows keep their quality.
  nodeCreated(node) {
    if (node?.comfyClass !== NODE_ID && node?.type !== NODE_ID) return;
    const quality = settingValue(SETTING_ID);
    if (!QUALITIES.includes(quality)) return;
    const widget = node.widgets?.find((w) => w.name === "quality");
    if (widget) widget.value = quality;
  },
});
