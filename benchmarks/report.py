"""docs/benchmarks.md, generated from the JSON that each part wrote, so that the tables and
the targets can never drift from the numbers. The prose is in benchmarks/text/*.md: templates that
str.format fills from a part's JSON ({settings[batches]:,}), with {x:size} for a byte count."""
import os
import string

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "text")
SUMMARY = [("part", "{part}"), ("target", "{target}"), ("measured", "{measured}"),
           ("", "{verdict}")]


class Formatter(string.Formatter):
    """str.format's rules, and two for the JSON: bytes read as people write sizes ({x:size}),
    and a number the run could not measure (None: MFU on a CPU) reads n/a."""

    def format_field(self, value, spec):
        if value is None:
            return "n/a"
        return size(value) if spec == "size" else super().format_field(value, spec)


FORMAT = Formatter()


def size(n_bytes):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            value = n_bytes / scale
            return f"{value:.0f} {unit}" if value >= 10 or value == int(value) \
                else f"{value:.1f} {unit}"
    return f"{n_bytes} B"


def fill(name, fields):
    """benchmarks/text/<name>.md with its {placeholders} filled from the dict `fields`."""
    with open(os.path.join(TEXT, f"{name}.md")) as f:
        return FORMAT.format(f.read(), **fields).rstrip("\n")


def table(columns, rows, **fields):
    """A markdown table of (header, template) columns, a line per row. A cell whose fields the
    row lacks is blank, except in a row that did not run, where the first one says why."""
    lines = [line(FORMAT.format(head, **fields) for head, _ in columns),
             "|---" * len(columns) + "|"]
    for row in rows:
        why = "" if row.get("status", "ok") == "ok" else row["status"]
        cells = []
        for _, template in columns:
            try:
                cells.append(FORMAT.format(template, **row))
            except KeyError:
                cells.append(why)
                why = ""
        lines.append(line(cells))
    return "\n".join(lines)


def line(cells):
    return "| " + " | ".join(cells) + " |"


def verdict(met):
    return {True: "**met**", False: "**not met**", None: "not run"}[met]


def section(name, title, tables, result, png):
    """One part's section: its text/<name>.md between the run's facts and its targets. A table
    lists the part's results, or the rows under its own name when the result has them."""
    settings = result.get("settings", {})
    body = fill(name, {**result, **{key: table(columns, result.get(key, result["results"]),
                                               **settings)
                                    for key, columns in tables.items()}})
    targets = "\n".join(f"- {verdict(t['met'])}: {t['target']}. Measured: {t['measured']}."
                        for t in result["targets"])
    gpu = result["machine"]["gpu"]
    return fill("section", {**result, "title": title, "body": body, "png": png,
                            "targets": targets, "minutes": result["elapsed_s"] / 60,
                            "gpu": f"GPU {gpu}" if gpu else "no GPU"})


def document(parts, data_dir):
    """The page from (name, title, tables, result, png) for each part that has results;
    data_dir and png are relative to the page."""
    summary = [{"part": title, **t, "verdict": verdict(t["met"])}
               for _, title, _, result, _ in parts for t in result["targets"]]
    blocks = [fill("intro", {"data_dir": data_dir, "targets": table(SUMMARY, summary)})]
    return "\n\n".join(blocks + [section(*part) for part in parts]) + "\n"


def colour(group):
    """What a line's colour stands for: its series fields but the last (the marker's), or its
    one field."""
    return group[:-1] or group


def line_plot(result, title, x, panels, series):
    """A figure of a panel per (key, label, unit, yscale) in `panels`, each with a line per
    group of rows that share the `series` fields (colour by all of them but the last, marker
    by the last), against x = (key, label, unit, xscale). Rows that did not run have no point."""
    from matplotlib.figure import Figure

    groups = {}
    for r in result["results"]:
        if r.get("status", "ok") == "ok":
            groups.setdefault(tuple(r[k] for k in series), []).append(r)
    colours = list(dict.fromkeys(colour(g) for g in groups))
    lasts = list(dict.fromkeys(g[-1] for g in groups))
    nrows = 2 if len(panels) > 3 else 1
    ncols = -(-len(panels) // nrows)
    fig = Figure(figsize=(4.5 * ncols + 2, 4 * nrows + 0.5), layout="constrained")
    xkey, xlabel, xunit, xscale = x
    for ax, (key, label, unit, yscale) in zip(fig.subplots(nrows, ncols).flat, panels):
        for group, rows in groups.items():
            ax.plot([r[xkey] / xunit for r in rows], [r[key] / unit for r in rows],
                    color=f"C{colours.index(colour(group))}",
                    marker="os^vD"[lasts.index(group[-1])],
                    label=", ".join(map(str, group)))
        ax.set(xscale=xscale, yscale=yscale, xlabel=xlabel, ylabel=label)
        if yscale == "linear":
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.legend(*fig.axes[0].get_legend_handles_labels(), loc="outside right center",
               fontsize=8, title=", ".join(series))
    fig.suptitle(title)
    return fig
