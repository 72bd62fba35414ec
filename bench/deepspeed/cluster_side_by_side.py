"""zerorun vs DeepSpeed 0.19.8 across simulated hosts: the 54.6M-parameter MLP (examples/mlp.rs, and
mlp_deepspeed.py for DeepSpeed), same data, data order, initial weights and ds_config.json, on H network namespaces
joined by links of RATE each way (`zerorun bench cluster`; DeepSpeed under `--launcher torchrun`, gloo, CPU
accelerator). Needs root.

    sudo make bench-deepspeed-cluster     (or: .venv/bin/python bench/deepspeed/cluster_side_by_side.py
                                           [--steps N] [--links 1gbit,10gbit] [--layouts 2x1,2x2] [--cases a,b])

Each case's two runs follow each other in one invocation, so the ratio compares runs seconds apart. ZeRO++ (hpZ +
qwZ + qgZ) and shard groups are zerorun's only: DeepSpeed's versions need CUDA, so the ratio there is against
DeepSpeed's plain stage 3, what its users get on such a cluster. Every rank runs one libtorch thread
(OMP_NUM_THREADS=1) under both, and `bench cluster` pins each host's launcher and ranks to its share of the CPUs. Writes cluster_results.json and cluster_results.md next to this file."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "../.."))
ZR = os.path.join(ROOT, "target/release/zerorun")
MLP = os.path.join(ROOT, "target/release/examples/mlp")
VENV_BIN = os.path.join(ROOT, ".venv/bin")
SHAPE = {"in": 1024, "hidden": 4096, "layers": 5, "out": 8}
# Uncompressed steps of the compression cases before the 1-bit exchange starts.
WARMUP = 2

# name: (zerorun's zero_optimization given the ranks per host (None: not run at that layout), DeepSpeed's; None:
# zerorun's only, measured against DeepSpeed's plain stage 3), and optionally (zerorun's, DeepSpeed's) top-level
# keys. hpZ and shard groups span a host's ranks.
CASES = {
    "stage0": (lambda k: {"stage": 0}, {"stage": 0}),
    # zerorun steps each bucket as its all-reduce lands (no clipping there), DeepSpeed's stage 0 without clipping.
    "stage0_in_backward": (
        lambda k: {"stage": 0},
        {"stage": 0},
        ({"gradient_clipping": 0.0, "optimizer_in_backward": True}, {"gradient_clipping": 0.0}),
    ),
    "stage2": (lambda k: {"stage": 2}, {"stage": 2}),
    "stage2_overlap": (lambda k: {"stage": 2, "overlap_comm": True}, {"stage": 2, "overlap_comm": True}),
    "stage3": (lambda k: {"stage": 3}, {"stage": 3}),
    "stage3_zeropp": (
        lambda k: {
            "stage": 3, "zero_hpz_partition_size": k, "zero_quantized_weights": True, "zero_quantized_gradients": True
        },
        None,
    ),
    "stage3_mics": (lambda k: {"stage": 3, "mics_shard_size": k} if k > 1 else None, None),
    # Compression (zerorun's 1-bit optimizers and PowerSGD at stage 0, warm-up of 2 steps) against DeepSpeed's
    # plain Adam at stage 0: DeepSpeed's own 1-bit optimizers need cupy and a GPU, and its engine has no PowerSGD.
    "onebit_adam": (
        lambda k: {"stage": 0},
        {"stage": 0},
        ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-4, "freeze_step": WARMUP}}}, {}),
    ),
    # 1-bit Adam at stage 1 (the gradient and the step's change as signs) against DeepSpeed's stage 0 Adam, as the
    # issue measures it (DeepSpeed refuses its 1-bit optimizers with any ZeRO stage).
    "onebit_adam_stage1": (
        lambda k: {"stage": 1},
        {"stage": 0},
        ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-4, "freeze_step": WARMUP}}}, {}),
    ),
    "onebit_lamb": (
        lambda k: {"stage": 0},
        {"stage": 0},
        ({"optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-4, "freeze_step": WARMUP, "coeff_beta": 0.5}}}, {}),
    ),
    "zero_one_adam": (
        lambda k: {"stage": 0},
        {"stage": 0},
        ({"optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-4, "var_freeze_step": WARMUP}}}, {}),
    ),
    # PowerSGD at stage 1: the whole gradient through the factors, each rank stepping its partition, the
    # parameters all-gathered after (against DeepSpeed's stage 0 Adam, as the other compressed cases).
    "powersgd_rank4_stage1": (
        lambda k: {"stage": 1},
        {"stage": 0},
        (
            {"gradient_compression": {"type": "powersgd", "matrix_approximation_rank": 4, "start_powerSGD_iter": WARMUP}},
            {},
        ),
    ),
    "powersgd_rank4": (
        lambda k: {"stage": 0},
        {"stage": 0},
        (
            {"gradient_compression": {"type": "powersgd", "matrix_approximation_rank": 4, "start_powerSGD_iter": WARMUP}},
            {},
        ),
    ),
}


def config(zero, batch, top=None):
    return {
        "train_batch_size": batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        # torch_adam: DeepSpeed's CPU path without offload is torch.optim.Adam (FusedAdam needs CUDA).
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": zero,
    } | (top or {})


def inputs(tmp):
    """The data (x ~ N(0,1), y a fixed linear map of sin x) and the initial weights, both from seed 0."""
    torch.manual_seed(0)
    x = torch.randn(1024, SHAPE["in"])
    w = torch.randn(SHAPE["in"], SHAPE["out"]) / SHAPE["in"] ** 0.5
    data = os.path.join(tmp, "data.safetensors")
    save_file({"x": x, "y": x.sin() @ w}, data)
    dims = [SHAPE["in"]] + [SHAPE["hidden"]] * (SHAPE["layers"] - 1) + [SHAPE["out"]]
    init = {}
    for i in range(SHAPE["layers"]):
        layer = torch.nn.Linear(dims[i], dims[i + 1])
        init[f"layers.{i}.weight"] = layer.weight.detach().contiguous()
        init[f"layers.{i}.bias"] = layer.bias.detach().contiguous()
    path = os.path.join(tmp, "init.safetensors")
    save_file(init, path)
    return data, path


def zero_floor(row):
    """The step over the link floor of the bytes ZeRO must move across hosts (the issue's target): per host and
    step 2(N-1)/N model bytes at stages 0-2, 3(N-1)/N at stage 3 (N hosts, each host's ranks sharing its link); the
    measured floor (`x floor`) also counts the start's broadcast and the end's evaluation. Blank for ZeRO++ and
    shard groups, which move other bytes by design."""
    case = row["case"]
    if "zeropp" in case or "mics" in case:
        return ""
    s = SHAPE
    params = s["in"] * s["hidden"] + s["hidden"] + (s["layers"] - 2) * (s["hidden"] ** 2 + s["hidden"])
    params += s["hidden"] * s["out"] + s["out"]
    n = row["hosts"]
    factor = 3 if case.startswith("stage3") else 2
    floor_s = factor * (n - 1) / n * params * 4 * 8 / row["zerorun"]["link_bits_per_s"]
    return f"{row['zerorun']['median_step_s'] / floor_s:.2f}"


def cluster(hosts, per_host, link, launcher, program):
    cmd = [ZR, "bench", "cluster", "--hosts", str(hosts), "--ranks-per-host", str(per_host), "--link", link, "--json"]
    if launcher == "torchrun":
        cmd += ["--launcher", "torchrun"]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PATH=VENV_BIN + ":" + os.environ["PATH"])
    out = subprocess.run(cmd + ["--"] + program, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} ({launcher}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--links", default="1gbit")
    p.add_argument("--layouts", default="2x1,2x2")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default="cluster_results", help="bench/deepspeed/OUT.{json,md}")
    a = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("cluster_side_by_side.py makes network namespaces: run it as root")
    for path in (ZR, MLP):
        if not os.path.exists(path):
            sys.exit(f"{path} missing: cargo build --release --bin zerorun --example mlp")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data, init = inputs(tmp)
        shape = sum(([f"--{k}", str(v)] for k, v in SHAPE.items()), [])
        common = ["--data", data, "--init", init, "--steps", str(a.steps)] + shape
        ds_runs = {}
        for link in a.links.split(","):
            for layout in a.layouts.split(","):
                hosts, per_host = map(int, layout.split("x"))
                for name in a.cases.split(","):
                    zr_zero, ds_zero = CASES[name][:2]
                    zr_top, ds_top = CASES[name][2] if len(CASES[name]) > 2 else ({}, {})
                    zr_zero = zr_zero(per_host)
                    if zr_zero is None:
                        continue
                    ds_zero = ds_zero if ds_zero is not None else {"stage": 3}
                    zr_cfg = os.path.join(tmp, f"{name}_zerorun.json")
                    ds_cfg = os.path.join(tmp, f"{name}_deepspeed.json")
                    json.dump(config(zr_zero, a.batch, zr_top), open(zr_cfg, "w"))
                    json.dump(config(ds_zero, a.batch, ds_top), open(ds_cfg, "w"))
                    zr = cluster(hosts, per_host, link, "zerorun", [MLP, "--config", zr_cfg] + common)
                    if "optimizer" in zr_top or "gradient_compression" in zr_top:
                        # The bytes of a compressed step: this run's less a run of the warm-up alone (the same
                        # start), over the steps between.
                        warm_args = common[: common.index("--steps")] + ["--steps", str(WARMUP)]
                        warm_args += common[common.index("--steps") + 2 :]
                        warm = cluster(hosts, per_host, link, "zerorun", [MLP, "--config", zr_cfg] + warm_args)
                        zr["compressed_step_bytes_per_rank"] = [
                            (b * a.steps - w * WARMUP) / (a.steps - WARMUP)
                            for b, w in zip(
                                zr["cross_host_bytes_per_rank_per_step"], warm["cross_host_bytes_per_rank_per_step"]
                            )
                        ]
                    # DeepSpeed's plain stage 3 once per layout and link serves every stage-3 row.
                    key = (link, layout, json.dumps(config(ds_zero, a.batch, ds_top), sort_keys=True))
                    if key not in ds_runs:
                        ds_runs[key] = cluster(
                            hosts, per_host, link, "torchrun",
                            [os.path.join(HERE, "mlp_deepspeed.py"), "--config", ds_cfg] + common,
                        )
                    ds = ds_runs[key]
                    row = {
                        "case": name, "link": link, "hosts": hosts, "ranks_per_host": per_host,
                        "zerorun": zr, "deepspeed": ds, "deepspeed_config": ds_zero,
                        "step_ratio": zr["median_step_s"] / ds["median_step_s"],
                    }
                    rows.append(row)
                    print(
                        f"{link} {layout} {name}: zerorun {zr['median_step_s']:.3f} s, DeepSpeed "
                        f"{ds['median_step_s']:.3f} s ({row['step_ratio']:.2f}x); cross-host MiB/rank/step "
                        f"{max(zr['cross_host_bytes_per_rank_per_step']) / 2**20:.1f} vs "
                        f"{max(ds['cross_host_bytes_per_rank_per_step']) / 2**20:.1f}; last loss "
                        f"{zr['last_loss']} vs {ds['last_loss']}",
                        flush=True,
                    )
    json.dump(rows, open(os.path.join(HERE, a.out + ".json"), "w"), indent=1)
    mib = lambda r: max(r["cross_host_bytes_per_rank_per_step"]) / 2**20
    lines = [
        f"54.6M-parameter MLP, fp32, global batch {a.batch}, {a.steps} steps (median of the last {a.steps - 2}), "
        "`sudo make bench-deepspeed-cluster`",
        "",
        "| link | hosts x ranks | case | zerorun step s | DeepSpeed step s | ratio | zerorun cross MiB/rank/step | DeepSpeed cross MiB/rank/step | zerorun x floor | DeepSpeed x floor | zerorun x ZeRO's floor | last loss zerorun / DeepSpeed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        zr, ds = r["zerorun"], r["deepspeed"]
        against = "" if CASES[r["case"]][1] is not None else " (vs DS stage 3)"
        lines.append(
            f"| {r['link']} | {r['hosts']}x{r['ranks_per_host']} | {r['case']}{against} | {zr['median_step_s']:.3f} | "
            f"{ds['median_step_s']:.3f} | {r['step_ratio']:.2f} | {mib(zr):.1f} | {mib(ds):.1f} | "
            f"{zr['step_over_floor']:.2f} | {ds['step_over_floor']:.2f} | {zero_floor(r)} | "
            f"{zr['last_loss']} / {ds['last_loss']} |"
        )
    compressed = [r for r in rows if "compressed_step_bytes_per_rank" in r["zerorun"]]
    if compressed:
        lines += [
            "",
            f"Compressed steps (after the {WARMUP}-step warm-up): cross-host bytes per rank per step, from this run's "
            "bytes less a warm-up-only run's, against DeepSpeed's uncompressed step.",
            "",
            "| link | hosts x ranks | case | zerorun MiB/rank/compressed step | DeepSpeed MiB/rank/step | fraction |",
            "|---|---|---|---|---|---|",
        ]
        for r in compressed:
            z = max(r["zerorun"]["compressed_step_bytes_per_rank"]) / 2**20
            d = mib(r["deepspeed"])
            lines.append(
                f"| {r['link']} | {r['hosts']}x{r['ranks_per_host']} | {r['case']} | {z:.2f} | {d:.1f} | 1/{d / z:.1f} |"
            )
    open(os.path.join(HERE, a.out + ".md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
