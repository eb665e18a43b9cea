#!/usr/bin/env python3
"""Answer headwise's exported examples with kvpress's own presses, then compare.

    headwise eval kv-examples eval/kvpress-check-smollm2.toml --to EXAMPLES.jsonl
    python eval/kvpress/crosscheck.py answer EXAMPLES.jsonl --gguf models/X.gguf --out DIR
    python eval/kvpress/crosscheck.py compare DIR

`answer` loads the GGUF with transformers (its tensors dequantized to f32), and for each
example prefills the context (`prompt[:question_start]`) inside the press's context
manager, then runs the question and greedy decoding outside it with explicit position
ids, as kvpress's pipeline does: its query-agnostic protocol, the one headwise's
kv-budget sweep runs. The prompt ids are headwise's, so both sides read the same tokens.
Answers stop at a stop token, at `max_new` tokens or at the first newline, and are
scored like headwise scores them (SQuAD-normalised containment). One JSON line per
(example, press) goes to DIR/kvpress-records.jsonl; a run resumes where it stopped.

`compare` pairs those records with headwise's own (DIR/records.jsonl, from
`headwise eval kv-budget`) by (example, policy name) and writes DIR/crosscheck.md: each
side's accuracy, their difference with a 95% interval (1.96 standard errors of the
per-example differences), and how often the two answers agree.
"""

import argparse
import importlib.metadata
import json
import math
import os
import string
import sys
import time

# The presses compared, by headwise's policy names.
PRESSES = {
    "full": None,
    "knorm-0.25": ("KnormPress", 0.25),
    "knorm-0.5": ("KnormPress", 0.5),
    "snapkv-0.25": ("SnapKVPress", 0.25),
    "snapkv-0.5": ("SnapKVPress", 0.5),
}


def normalize(text):
    """Lower case, ASCII punctuation dropped, articles dropped, whitespace collapsed."""
    kept = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(w for w in kept.split() if w not in ("a", "an", "the"))


def contains(aliases, prediction):
    padded = f" {normalize(prediction)} "
    return float(any(normalize(a) and f" {normalize(a)} " in padded for a in aliases))


def score(metric, answers, prediction):
    if metric == "accuracy":
        return contains(answers, prediction)
    if metric == "recall_all":
        return sum(contains([a], prediction) for a in answers) / max(len(answers), 1)
    raise SystemExit(f"error: metric {metric} is not scored here")


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def answer(args):
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
    import kvpress

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    lines = read_jsonl(args.examples)
    header, examples = lines[0], lines[1:]
    if args.limit:
        examples = examples[: args.limit]
    folder, name = os.path.split(os.path.abspath(args.gguf))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    stop, max_new = set(header["stop"]), header["max_new"]
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "kvpress-records.jsonl")
    done = {(r["example"], r["policy"]) for r in read_jsonl(out_path)}
    info = {
        "kvpress": importlib.metadata.version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model_sha256": header["model_sha256"],
        "attention": model.config._attn_implementation,
    }
    print(json.dumps(info), file=sys.stderr)
    t0 = time.time()
    with open(out_path, "a") as out:
        for i, line in enumerate(examples):
            ex = line["example"]
            for policy, press_spec in PRESSES.items():
                if (ex["id"], policy) in done:
                    continue
                press = None
                if press_spec is not None:
                    cls, ratio = press_spec
                    press = getattr(kvpress, cls)(compression_ratio=ratio)
                prediction, kept = generate(
                    model, tok, ex["prompt"], ex["question_start"], press, stop, max_new
                )
                record = {
                    "task": line["task"],
                    "example": ex["id"],
                    "policy": policy,
                    "prediction": prediction,
                    "score": score(line["metric"], ex["answers"], prediction),
                    "kept_positions": kept,
                    **info,
                }
                out.write(json.dumps(record) + "\n")
                out.flush()
            print(f"{i + 1}/{len(examples)} examples, {time.time() - t0:.0f} s", file=sys.stderr)


def generate(model, tok, prompt, question_start, press, stop, max_new):
    """Greedy answer to `prompt` with the context pressed; returns (answer, positions
    the first layer's cache kept)."""
    import contextlib

    import torch
    from transformers import DynamicCache

    context = torch.tensor([prompt[:question_start]])
    question = torch.tensor([prompt[question_start:]])
    cache = DynamicCache()
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            model(input_ids=context, past_key_values=cache)
        kept = cache.get_seq_length()
        n = context.shape[1]
        positions = torch.arange(n, n + question.shape[1]).unsqueeze(0)
        logits = model(input_ids=question, past_key_values=cache, position_ids=positions).logits
        ids = []
        position = n + question.shape[1]
        for _ in range(max_new):
            token = int(logits[0, -1].argmax())
            if token in stop:
                break
            ids.append(token)
            if "\n" in tok.decode(ids).lstrip():
                break
            step = torch.tensor([[token]])
            logits = model(
                input_ids=step, past_key_values=cache, position_ids=torch.tensor([[position]])
            ).logits
            position += 1
    text = tok.decode(ids).lstrip()
    first = text.splitlines()[0].strip() if text else ""
    return first, kept


def compare(args):
    ours = {(r["example"], r["policy"]): r for r in read_jsonl(os.path.join(args.dir, "records.jsonl"))}
    theirs = read_jsonl(os.path.join(args.dir, "kvpress-records.jsonl"))
    if not theirs:
        raise SystemExit(f"error: {args.dir}/kvpress-records.jsonl has no records")
    info = {k: theirs[0][k] for k in ("kvpress", "transformers", "torch", "attention")}
    rows = []
    for policy in PRESSES:
        pairs = []
        for r in theirs:
            mine = ours.get((r["example"], policy))
            if r["policy"] == policy and mine is not None:
                pairs.append((next(iter(mine["scores"].values())), r["score"], mine["prediction"], r["prediction"]))
        if not pairs:
            continue
        n = len(pairs)
        diffs = [a - b for a, b, _, _ in pairs]
        mean = sum(diffs) / n
        var = sum((d - mean) ** 2 for d in diffs) / max(n - 1, 1)
        half = 1.96 * math.sqrt(var / n)
        same = sum(1 for _, _, p, q in pairs if normalize(p) == normalize(q))
        both = sum(1 for a, b, _, _ in pairs if a == b)
        rows.append(
            f"| {policy} | {n} | {sum(a for a, *_ in pairs) / n:.2f} | {sum(b for _, b, *_ in pairs) / n:.2f} "
            f"| {mean:+.2f} ({mean - half:+.2f} to {mean + half:+.2f}) | {both} | {same} |"
        )
    md = [
        "# headwise's presses against kvpress's own\n",
        "The same prompt ids (`headwise eval kv-examples`) answered by headwise's policies "
        "(`records.jsonl`, `headwise eval kv-budget`) and by kvpress's presses on the model "
        "transformers loads from the same GGUF (`kvpress-records.jsonl`, "
        "`python eval/kvpress/crosscheck.py answer`), both pressing the context alone. "
        f"kvpress {info['kvpress']}, transformers {info['transformers']}, torch "
        f"{info['torch']} ({info['attention']} attention), CPU.\n",
        "| policy | n | headwise accuracy | kvpress accuracy | headwise − kvpress (95% CI) | same score | same answer |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Command: `python eval/kvpress/crosscheck.py compare " + args.dir + "`",
        "",
    ]
    path = os.path.join(args.dir, "crosscheck.md")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(md))
    os.replace(tmp, path)
    print("\n".join(md))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("answer")
    a.add_argument("examples")
    a.add_argument("--gguf", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--limit", type=int, default=0)
    c = sub.add_parser("compare")
    c.add_argument("dir")
    args = p.parse_args()
    {"answer": answer, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
