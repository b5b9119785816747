"""PNG plots of a `kvstate bench` run (matplotlib, imported inside `write_plots`; Agg backend, no display)."""

from __future__ import annotations

from pathlib import Path

from executor.bench.results import Section

OURS, PEER, TARGET = "#1565c0", "#9e9e9e", "#c62828"


def write_plots(sections: list[Section], out_dir: str | Path) -> list[Path]:
    """Write one PNG per benchmark present in `sections`; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_name = {s.name: s for s in sections}
    written = []
    for name, draw in (
        ("migration", _migration),
        ("scheduler", _scheduler),
        ("vllm", _scheduler),
        ("nano-vllm", _scheduler),
    ):
        if name in by_name:
            fig = draw(plt, by_name[name])
            written.append(_save(fig, out / f"{name}.png", plt))
    if "decode" in by_name or "host_tier" in by_name:  # decode: the `transformers` group
        fig = _end_to_end(plt, by_name.get("decode"), by_name.get("host_tier"))
        written.append(_save(fig, out / "end_to_end.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _migration(plt, section: Section):
    series = section.data["series"]
    sizes = sorted({s["block_bytes"] for s in series})
    keys = sorted({(s["op"], s["layout"]) for s in series}, key=lambda k: (k[0] != "offload", k[1]))
    fig, ax = plt.subplots(figsize=(12, 4.6))
    width = 0.8 / len(keys)
    colors = plt.get_cmap("tab20").colors
    for i, key in enumerate(keys):
        ratios = [
            next(
                s["gbps"] / s["baseline_gbps"]
                for s in series
                if (s["op"], s["layout"]) == key and s["block_bytes"] == size
            )
            for size in sizes
        ]
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(sizes))]
        ax.bar(xs, ratios, width, label=f"{key[0]} {key[1]}", color=colors[i * 2 % len(colors)])
    goal = 0.8 if section.data["device"] == "cuda" else 0.7
    ax.axhline(goal, color=TARGET, linestyle="--", linewidth=1.2, label=f"target {goal} (default block size)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(sizes)), [f"{b >> 10} KiB blocks" for b in sizes])
    ax.set_ylabel("bandwidth / contiguous copy (same run)")
    ax.set_title(
        f"Migration bandwidth vs one contiguous copy of the same {section.data['total_bytes'] >> 20} MiB "
        f"({section.data['device']})"
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_ylim(0, 1.3)
    return fig


def _scheduler(plt, section: Section):
    """Per-request step and schedule() cost against size for every driver of the section (ours, and the peer's in
    the `vllm` and `nano-vllm` sections): flat lines are linear growth."""
    sizes, figures = section.data["sizes"], section.data["figures"]
    series = sorted({key.split(" ", 1)[1] for key in figures})  # "steady ours machine", "pressure vllm", ...
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    colors = plt.get_cmap("tab10").colors
    for i, name in enumerate(series):
        style = "-" if name.startswith("steady") else "--"
        peer = name.endswith(section.name)  # "steady vllm", "pressure nano-vllm": the peer's drivers
        color = PEER if peer else colors[i % len(colors)]
        for ax, what in ((left, "step_us_per_request"), (right, "schedule_us_per_request")):
            ax.plot(
                sizes,
                [figures[f"{n} {name}"][what] for n in sizes],
                style,
                marker="o",
                color=color,
                label=name.replace(section.name, section.data.get("peer") or section.name) if peer else name,
            )
    left.axhline(1.0, color=TARGET, linestyle=":", label="target: 1 µs per request (1,024 and 4,096)")
    left.set(title="full step (schedule + completion)", ylabel="µs per running request (median)")
    right.set(title="schedule() alone", ylabel="µs per running request (median)")
    for ax in (left, right):
        ax.set(xscale="log", xlabel="running requests", yscale="log")
        ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    left.legend(fontsize=7, loc="best")
    return fig


def _end_to_end(plt, decode: Section | None, host: Section | None):
    fig, axes = plt.subplots(1, 3, figsize=(12, 4.2))
    if decode is not None:
        per_batch = decode.data["per_batch"]
        batches = list(per_batch)
        xs = range(len(batches))
        axes[0].bar(
            [x - 0.2 for x in xs], [per_batch[b]["engine"] for b in batches], 0.4, color=OURS, label="kvstate Engine"
        )
        if decode.data["missing"] is None:
            axes[0].bar(
                [x + 0.2 for x in xs],
                [per_batch[b]["transformers"] for b in batches],
                0.4,
                color=PEER,
                label="transformers generate",
            )
        axes[0].set_xticks(list(xs), [f"batch {b}" for b in batches])
        axes[0].set(ylabel="decode tokens/s", title="Decode (same weights, float32)")
        axes[0].legend(fontsize=8)
    if host is not None:
        runs = host.data["runs"]
        names = list(runs)
        labels = [f"{n}\n({host.data['host_blocks'][n]} blocks)" for n in names]
        axes[1].bar(labels, [runs[n]["tokens_per_s"] for n in names], color=[PEER, "#64b5f6", OURS])
        axes[1].set(ylabel="generated tokens/s", title="Host tier size: throughput")
        axes[2].bar(labels, [runs[n]["recomputed"] for n in names], color=[PEER, "#64b5f6", OURS])
        axes[2].set(ylabel="tokens recomputed (replay)", title="Host tier size: recomputation")
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    return fig
