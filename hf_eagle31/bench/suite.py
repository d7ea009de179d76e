"""The benchmark suite: EAGLE-3 / 3.1 against the target alone, assisted generation and prompt lookup, in one run.

`run_benchmark` (`hf-eagle31 bench`; defaults: SmolLM2-135M-Instruct with its shipped drafters on four benchmark
sets; `--pair demo` for the 17M demo pair) writes results.json, results.md and plots to --out. With a drafter,
the tree shape is first tuned to this device (see `hf_eagle31.tuning`).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import shlex
from pathlib import Path

import torch

from hf_eagle31.compat import LOAD_KWARGS
from hf_eagle31.training.data import read_jsonl

DEMO = Path("examples/demo_pair")
SMOLLM2 = Path("examples/smollm2")
EMBEDDING = "model.embed_tokens.weight"  # an assistant saved without it takes the target's (`load_assistant`)
CALIBRATION_PROMPTS = 10  # tuning is only as good as its acceptance sample
PAIRS = {  # --pair: the models and prompts a run uses unless given one by one
    "smollm2": dict(target="smollm2-135m-instruct", eagle3=str(SMOLLM2 / "eagle3"), eagle31=str(SMOLLM2 / "eagle31"),
                    assistant=str(SMOLLM2 / "small_lm"),
                    prompts=[str(SMOLLM2 / "prompts" / f"{n}.jsonl") for n in ("mt_bench", "gsm8k", "humaneval", "alpaca")],
                    documents=str(SMOLLM2 / "heldout_conversations.jsonl"),
                    calibration=str(SMOLLM2 / "heldout_conversations.jsonl")),
    "demo": dict(target=str(DEMO / "target"), eagle3=str(DEMO / "eagle3"), eagle31=str(DEMO / "eagle31"),
                 assistant=str(DEMO / "small_lm"), prompts=[str(DEMO / "heldout_prompts.jsonl")],
                 documents=str(DEMO / "heldout_documents.jsonl"), calibration=""),
}


def resolve_pair(args: argparse.Namespace) -> None:
    """Fill the settings left unset from `--pair`; a target of one's own keeps only what was given."""
    pair = PAIRS[args.pair]
    own_target = args.target is not None and args.target != pair["target"]
    for key, value in pair.items():
        if getattr(args, key) is None:
            setattr(args, key, "" if own_target and key in ("eagle3", "eagle31", "assistant", "calibration") else value)


def read_texts(path: str, all_turns: bool = False) -> list[str]:
    """Prompt texts from JSONL lines with `text` or `turns` (the first turn, or all of them joined)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    records = list(read_jsonl(Path(path)))
    texts = [prompt_text(record, path, number, all_turns) for number, record in enumerate(records, 1)]
    if not texts:
        raise ValueError(f"no prompts in {path}")
    return texts


def prompt_text(record, path: str, number: int, all_turns: bool) -> str:
    """A record's `text`, or its `turns` (the first, or all joined); a record with neither is named."""
    turns = record.get("turns") if isinstance(record, dict) else None
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return record["text"]
    if not isinstance(turns, list) or not turns or not all(isinstance(turn, str) for turn in turns):
        raise ValueError(f"{path}: prompt record {number} has neither a 'text' string nor a non-empty list of "
                         "'turns' strings")
    return "\n\n".join(turns) if all_turns else turns[0]


def read_documents(path: str) -> list[str] | list[list[dict]]:
    """--drift's long contexts: whole conversations (records with 'messages') or texts ('text' / joined 'turns')."""
    records = list(read_jsonl(Path(path))) if Path(path).is_file() else []
    if records and all("messages" in r for r in records):
        return [r["messages"] for r in records]
    return read_texts(path, all_turns=True)


def split_prompts(texts: list[str], measured: int, calibration: int = CALIBRATION_PROMPTS) -> tuple[list[str], list[str]]:
    """`measured` prompts spread evenly over the file, and up to `calibration` others for tuning.

    Spreading keeps every kind of prompt in a file sorted by kind; tuning on prompts that are not
    measured keeps the choice of draft shape honest.
    """
    pick = lambda items, n: [items[i * len(items) // n] for i in range(min(n, len(items)))]  # noqa: E731
    chosen = pick(texts, measured)
    rest = [t for t in texts if t not in chosen]
    return chosen, pick(rest, calibration) or chosen[:calibration]


def drafter_folders(args) -> tuple[tuple[str, str | None], ...]:
    """Each drafter's method name and the folder the command line gave for it (None or '' for none)."""
    return ("EAGLE-3", args.eagle3), ("EAGLE 3.1", args.eagle31)


def load_models(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_eagle31.generation import drafting_dtype, prepare_drafter
    from hf_eagle31.modeling import Eagle3DraftModel
    from hf_eagle31.packaged import resolve_model

    if args.dtype == "auto":  # most CPUs have no bf16 matrix units: batched bf16 matmuls are slow there
        dtype = torch.float32 if args.device == "cpu" else "auto"
    else:
        dtype = getattr(torch, args.dtype)
    path = resolve_model(args.target)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **LOAD_KWARGS).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    drafters = {}
    drafter_dtype = getattr(torch, args.drafter_dtype) if args.drafter_dtype else drafting_dtype(target)
    for name, path in drafter_folders(args):
        if path:
            drafter = Eagle3DraftModel.from_pretrained(path, compile_verify=args.compile_verify)
            drafter = drafter.to(args.device, drafter_dtype).eval()
            prepare_drafter(target, drafter)
            drafters[name] = drafter
    assistant = load_assistant(args.assistant, target) if args.assistant else None
    return target, tokenizer, drafters, assistant


def load_assistant(path: str | Path, target):
    """A small LM for transformers' assisted generation, in the target's dtype and on its device.

    A checkpoint saved without its input embedding takes the target's, shared and tied to its head as the config
    says: examples/smollm2/small_lm shares SmolLM2's vocabulary and embedding, which were 57 of its 71 MB.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    weights = Path(path) / "model.safetensors"
    if not weights.is_file() or EMBEDDING in safe_open(weights, "pt").keys():  # sharded, or complete
        return AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype, **LOAD_KWARGS).to(target.device).eval()
    config = AutoConfig.from_pretrained(path)
    embedding = target.get_input_embeddings()
    if tuple(embedding.weight.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(f"{path} takes its input embedding from the target, whose embedding is "
                         f"{tuple(embedding.weight.shape)}, not ({config.vocab_size}, {config.hidden_size})")
    model = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    model.set_input_embeddings(embedding)
    missing, unexpected = model.load_state_dict(load_file(weights), strict=False)
    if unexpected or set(missing) - {EMBEDDING, *(["lm_head.weight"] if config.tie_word_embeddings else [])}:
        raise ValueError(f"{weights} does not fit its config (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    model.generation_config = GenerationConfig.from_pretrained(path)
    return model.to(target.device).eval()


def machine(device: str) -> str:
    """What ran the benchmark, in words: the GPU, or the CPU model, the instructions torch used on it (AVX2 where it
    lacks AVX-512 or `ATEN_CPU_CAPABILITY` masks it: other products, rows.py) and its threads."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        model = names[0] if names else model
    return f"{model}, {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads (CPU)"


def tune(target, drafters: dict, prompts, max_new_tokens, out: Path, resume: bool, temperature: float) -> dict:
    """Calibrate on a few prompts, then choose each drafter's shape for this device (see `hf_eagle31.tuning`), for
    sampling at the run's `temperature` too; a resumed run applies the shapes its first run chose, so every part
    uses the same ones."""
    from hf_eagle31.tuning import apply_choice, tune_drafter

    saved = out / "tuning.json"
    if resume and saved.exists():
        tuning = json.loads(saved.read_text())
        for name, drafter in drafters.items():
            apply_choice(drafter, tuning[name])
        return tuning
    tuning = {name: tune_drafter(target, d, prompts, max_new_tokens, sampling_temperature=temperature or None).as_dict()
              for name, d in drafters.items()}
    saved.write_text(json.dumps(tuning, default=str))
    return json.loads(saved.read_text())  # as a resumed run will read it


def shipped_tuning(args) -> dict:
    """With --no-tune: each drafter folder's own tuning.json (this kind of device's costs and the acceptance it was
    tuned with when shipped), so the bound column still has the costs it needs."""
    found = {}
    for name, folder in drafter_folders(args):
        saved = Path(folder) / "tuning.json" if folder else None
        if saved is not None and saved.is_file():
            found[name] = json.loads(saved.read_text())
    return found


def run_in_parts(target, measured: dict[str, list[torch.Tensor]], methods, args) -> dict:
    """Every method on each part of each dataset, parts taken in turn across datasets (an interrupted run has
    covered all of them evenly); each part's results are saved as it ends. Speedups are summed times, every
    part's methods having run in one process."""
    from dataclasses import asdict

    from hf_eagle31.bench.roofline import read_bandwidth
    from hf_eagle31.bench.runner import MethodResult, combine, run_all

    folder = Path(args.out) / "parts"
    size = args.part_size or max(len(prompts) for prompts in measured.values())
    parts = {name: [prompts[i : i + size] for i in range(0, len(prompts), size)] for name, prompts in measured.items()}
    done: dict[str, list] = {name: [] for name in parts}
    rounds = max(len(p) for p in parts.values())
    for index in range(min(rounds, args.max_parts or rounds)):
        for name, chunks in parts.items():
            if index >= len(chunks):
                continue
            path = folder / f"{name}_{index:03d}.json"
            if path.exists():
                results = [MethodResult(**r) for r in json.loads(path.read_text())]
            else:
                results = run_all(target, chunks[index], methods, args.max_new_tokens, temperature=args.temperature,
                                  probe=functools.partial(read_bandwidth, target.device))
                path.with_suffix(".tmp").write_text(json.dumps([asdict(r) for r in results]))
                path.with_suffix(".tmp").replace(path)
            done[name].append(results)
    return {name: (combine(runs), sum(len(chunk) for chunk in parts[name][: len(runs)]))
            for name, runs in done.items() if runs}


def prepare_out(args: argparse.Namespace, meta: dict) -> Path:
    """The output folder: a fresh run starts it empty of parts; --resume only where the settings are the same."""
    out = Path(args.out)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    settings = out / "settings.json"
    mine = {"command": command_line(args, skip=("resume", "max_parts")), "prompts": meta["prompts"]}
    if args.resume:
        if settings.exists() and json.loads(settings.read_text()) != mine:
            raise ValueError(f"{out} holds a run with other settings ({json.loads(settings.read_text())['command']}); "
                             "resume with the same settings or choose another --out")
    else:
        for stale in [*(out / "parts").glob("*.json"), out / "tuning.json"]:
            stale.unlink(missing_ok=True)
    settings.write_text(json.dumps(mine, indent=1) + "\n")
    return out


def methods_for(drafters, assistant, lookup_tokens, verify_modes: bool = False, sampling: bool = False,
                compiled: bool = False):
    """The rows of the table. A drafter's chain and tree are its greedy-tuned ones; when `sampling`, the shape
    tuned for sampling (`sampling_shape`) is a row of its own, so the two calibrations meet in one run. `compiled`
    (`--compile-verify`): the drafters verify with the compiled lean forward, so fast decoding compiles its step
    too, or the best plain decoding would be handicapped against them."""
    from hf_eagle31.bench.runner import Method

    from hf_eagle31.generation import fast_decoding

    # plain generate as users run it by default, then the fastest plain decoding this package offers
    fast = {"custom_generate": fast_decoding, **({"compile_step": True} if compiled else {})}
    methods = [Method("target alone"), Method("target alone, fast decoding", fast)]
    if assistant is not None:
        methods.append(Method("assisted (small LM)", {"assistant_model": assistant}))
    methods.append(Method("prompt lookup", {"prompt_lookup_num_tokens": lookup_tokens}))
    for name, drafter in drafters.items():
        for mode in ("chain", "tree"):
            methods.append(Method(f"{name} {mode}", {"assistant_model": drafter},
                                  {"speculation_mode": mode, "sampling_shape": None}))
        shape = getattr(drafter.generation_config, "sampling_shape", None)
        if sampling and shape:
            width, depth = shape["tree_top_k"], shape["tree_depth"]
            methods.append(Method(f"{name} sampling shape", {"assistant_model": drafter}, {
                "speculation_mode": "chain" if width == 1 else "tree", "num_assistant_tokens": depth,
                "tree_top_k": width, "tree_depth": depth, "tree_total_tokens": shape["tree_total_tokens"],
                "sampling_shape": None}))
    if verify_modes and "EAGLE 3.1" in drafters:  # the options measured: micro-batched and bit-exact verification
        drafter = {"assistant_model": drafters["EAGLE 3.1"]}
        methods.append(Method("EAGLE 3.1 tree, micro-batched verify", drafter,
                              {"speculation_mode": "tree", "verify_chunk_depth": 2, "sampling_shape": None}))
        methods.append(Method("EAGLE 3.1 tree, exact verify", drafter,
                              {"speculation_mode": "tree", "verify_mode": "exact", "sampling_shape": None}))
    return methods


def projections(args, tuning: dict, dtype: torch.dtype) -> dict:
    """Real-shape costs in the dtype the benchmark ran in (float32 on a CPU: bf16 matmuls are slow there)."""
    from hf_eagle31.bench.projection import REAL_SHAPES, measure_costs, project

    ranks = tuning.get("EAGLE 3.1", next(iter(tuning.values()), {})).get("calibration_ranks")
    if not ranks:
        raise ValueError("--project needs the EAGLE 3.1 acceptance measured by tuning (drop --no-tune)")
    ranks = {int(k): v for k, v in ranks.items()}  # top-k keys, strings once the tuning went through JSON
    unknown = set(args.project) - set(REAL_SHAPES)
    if unknown:
        raise ValueError(f"unknown shapes {sorted(unknown)}; known: {sorted(REAL_SHAPES)}")
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 65]
    return {
        shape: project(measure_costs(REAL_SHAPES[shape], sizes, list(range(1, 9)), device=args.device, dtype=dtype), ranks)
        for shape in args.project
    }


def measure_roofline(target, drafters: dict, args: argparse.Namespace, bandwidths: list[float]):
    """The memory roofline of the target's step on this machine, and beside it the verify cost curve of blocks of
    1-16 rows on the layers the drafter reads (None without a drafter): both measured after the methods ran, the
    roofline at the fastest of the read bandwidths probed around them (`bandwidths`) and after them."""
    from hf_eagle31.bench.roofline import Roofline
    from hf_eagle31.bench.verify_cost import SIZES, measure

    roofline, verify = Roofline.measure(target, bandwidths), None
    if drafters:
        layer_ids = drafters.get("EAGLE 3.1", next(iter(drafters.values()))).config.target_layer_ids
        verify = measure(target, layer_ids, rounds=3, compiled=args.compile_verify,
                         sizes=tuple(n for n in SIZES if n <= 16))
    return roofline, verify


def command_line(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> str:
    """The run's every setting as a command that repeats it (flags only when set)."""
    words = ["hf-eagle31", "bench"]
    for key, value in vars(args).items():
        flag = "--" + key.replace("_", "-")
        if key == "command" or key in skip or value is None or value is False:
            continue
        if value is True:
            words.append(flag)
        else:
            words += [flag, *map(str, value if isinstance(value, list) else [value])]
    return shlex.join(words)


def uses_chat_template(tokenizer, args) -> bool:
    """A chat model is benchmarked as it is used: through its chat template (unless --no-chat-template)."""
    return bool(getattr(tokenizer, "chat_template", None)) and not args.no_chat_template


def run_benchmark(args: argparse.Namespace) -> int:
    """`hf-eagle31 bench`: every study the parsed `args` ask for, written to `args.out`."""
    from hf_eagle31.bench.drift import prompt_encoders, run_drift_study

    resolve_pair(args)
    datasets = {Path(path).stem: read_texts(path) for path in args.prompts}
    target, tokenizer, drafters, assistant = load_models(args)
    plain, _ = prompt_encoders(tokenizer, uses_chat_template(tokenizer, args))
    meta = {
        "command": command_line(args),
        "date": datetime.date.today().isoformat(),
        "machine": machine(args.device),
        "torch": torch.__version__,
        "dtype": str(target.dtype),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
    }
    if args.drift:
        texts = [t for texts in datasets.values() for t in split_prompts(texts, args.num_prompts)[0]]
        documents = read_documents(args.documents) if args.documents else None
        return run_drift_study(target, tokenizer, drafters, texts, args, documents, meta,
                               uses_chat_template(tokenizer, args))
    if args.verify_cost:
        from hf_eagle31.bench.verify_cost import run_verify_cost_study

        return run_verify_cost_study(target, drafters, args, meta)
    if args.batch_sizes:
        from hf_eagle31.bench.batching import run_batched_study

        texts = [t for texts in datasets.values() for t in split_prompts(texts, args.num_prompts)[0]]
        return run_batched_study(target, tokenizer, drafters, texts, plain, args, meta)
    encode = lambda text: torch.tensor([plain(text)], device=args.device)  # noqa: E731
    measured, calibration = measured_and_calibration(datasets, encode, args)
    return run_comparison(target, drafters, assistant, measured, calibration, args, meta)


def measured_and_calibration(datasets: dict[str, list[str]], encode, args: argparse.Namespace
                             ) -> tuple[dict[str, list[torch.Tensor]], list[torch.Tensor]]:
    """Each set's measured prompts, and the prompts tuning calibrates on: never a measured one."""
    measured, calibration = {}, []
    for name, texts in datasets.items():
        chosen, others = split_prompts(texts, args.num_prompts, max(1, CALIBRATION_PROMPTS // len(datasets)))
        measured[name] = [encode(t) for t in chosen]
        calibration += [encode(t) for t in others]
    if args.calibration:  # prompts of their own: tuning never sees a measured prompt, however many are measured
        calibration = [encode(t) for t in split_prompts(read_texts(args.calibration), CALIBRATION_PROMPTS, 0)[0]]
    return measured, calibration


def run_comparison(target, drafters: dict, assistant, measured: dict[str, list[torch.Tensor]],
                   calibration: list[torch.Tensor], args: argparse.Namespace, meta: dict) -> int:
    """The methods' table over the measured prompts, with the draft shapes tuned (or shipped) and the roofline."""
    from hf_eagle31.bench.report import write_results
    from hf_eagle31.bench.runner import combine

    meta["prompts"] = {name: len(p) for name, p in measured.items()}
    out = prepare_out(args, meta)
    if args.no_tune:
        tuning = shipped_tuning(args)
        meta["tuning_source"] = ("each drafter's tuning.json (measured where it was tuned before it shipped, not in "
                                "this run)") if tuning else None
    else:
        tuning = tune(target, drafters, calibration, args.max_new_tokens, out, args.resume, args.temperature)
        meta["tuning_source"] = "this run (calibration prompts, then this device's costs)"
    methods = methods_for(drafters, assistant, args.prompt_lookup_tokens, args.verify_modes, args.temperature > 0,
                          args.compile_verify)
    per_dataset = run_in_parts(target, measured, methods, args)
    results = combine([r for r, _ in per_dataset.values()])
    prompts = sum(n for _, n in per_dataset.values())
    meta["prompts"] = {name: n for name, (_, n) in per_dataset.items()}  # measured, with --max-parts fewer than chosen
    if args.project:
        meta["projections"] = projections(args, tuning, target.dtype)
    probed = [r.bandwidth for r in results if r.bandwidth]  # around each method's calls (`run_in_parts`)
    roofline, verify = measure_roofline(target, drafters, args, probed)
    write_results(Path(args.out), results, prompts, meta, tuning, per_dataset if len(per_dataset) > 1 else None,
                  roofline, verify)
    print_comparison(results, prompts, per_dataset, tuning, roofline, verify, meta)
    print(f"\nwritten to {args.out}/ (results.json, results.md, speed.png, acceptance.png, verify_cost.png)")
    return 0


def print_comparison(results, prompts: int, per_dataset: dict, tuning: dict, roofline, verify, meta: dict) -> None:
    from hf_eagle31.bench.report import dataset_table, headline, markdown_table, roofline_text, tuning_table

    print(markdown_table(results, prompts, tuning, roofline))
    if len(per_dataset) > 1:
        print("\n" + dataset_table({k: v[0] for k, v in per_dataset.items()}, {k: v[1] for k, v in per_dataset.items()}))
    print("\n" + "\n".join(headline(results, prompts, roofline)))
    print("\n" + roofline_text(roofline, verify, results))
    if tuning:
        print("\n" + tuning_table(tuning, meta.get("tuning_source")))
    for shape, projection in meta.get("projections", {}).items():
        best = projection["best"]
        verdict = "" if best["speedup"] > 1 else " (no draft shape pays here: plain decoding is faster)"
        print(f"\nPROJECTION for {shape} on this device (costs extrapolated, acceptance of the demo EAGLE 3.1): "
              f"step {projection['step_seconds'] * 1000:.1f} ms, t(n)/t(1) "
              + ", ".join(f"{n}: {r:.2f}" for n, r in projection["verify_cost_ratio"].items())
              + f"; best draft top-k {best['tree_top_k']}, depth {best['tree_depth']}, {best['tree_total_tokens']} "
              f"tokens, tau {best['tau']:.2f}, projected speedup {best['speedup']:.2f}x{verdict}")
