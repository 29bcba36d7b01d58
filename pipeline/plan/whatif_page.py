"""The what-if as a self-contained HTML page (`tokenmill estimate --hardware ... --volume N --html FILE`): the
projection per tier, the break-even against each API batch offer, a chart of $/document against documents per night
with the API lines, and which figures are measured and which projected. No script or font from the network."""

from __future__ import annotations

from pathlib import Path

from markupsafe import Markup

from pipeline.output.charts import fmt_usd, line_chart


def _rows(head: list[str], rows: list[list[str]]) -> Markup:
    cells = Markup("").join(Markup("<th>{}</th>").format(h) for h in head)
    body = Markup("").join(
        Markup("<tr>{}</tr>").format(Markup("").join(Markup("<td>{}</td>").format(c) for c in r)) for r in rows
    )
    return Markup('<table class="quality"><tr>{}</tr>{}</table>').format(cells, body)


def _never(n: float | None) -> str:
    return "never (the API costs less per document)" if n is None else f"{n:,.0f} documents/night"


def what_if_section(projection: dict, break_even: dict | None) -> Markup:
    """The projection's tiers and, with a volume, each mix's break-even and its chart."""
    parts = [
        Markup("<h2>What-if: {}</h2><p class='note'>{}</p>").format(projection["hardware"], projection["label"]),
        _rows(
            ["tier", "model", "engine-hours", "GPU-hours", "USD"],
            [
                [n, t["model"], f"{t['engine_hours']:.3g}", f"{t['gpu_hours']:.3g}", fmt_usd(t["usd"])]
                for n, t in projection["tiers"].items()
            ],
        ),
    ]
    if break_even:
        volume = break_even["volume_documents_per_night"]
        for mix, m in break_even["mixes"].items():
            parts.append(Markup("<h3>{} ({})</h3>").format(mix, ", ".join(m["tiers"])))
            rows = [
                [
                    api,
                    fmt_usd(a["usd_per_1k_documents"]),
                    _never(a["break_even_documents"]),
                    "-" if a["ratio_at_volume"] is None else f"{a['ratio_at_volume']:.2f}×",
                ]
                for api, a in m["api"].items()
            ]
            rows.insert(0, ["self-hosted", fmt_usd(m["usd_per_1k_documents_at_volume"]), "", "1×"])
            parts.append(_rows(["", f"$/1k documents at {volume:,}/night", "break-even volume", "ratio"], rows))
            c = break_even["curve"][mix]
            parts.append(
                line_chart(
                    f"break-even-{len(parts)}",
                    f"$/document against documents per night: {mix}",
                    c["volumes"],
                    {"self-hosted (projected)": c["self_hosted"], **c["api"]},
                    "documents/night",
                )
            )
        parts.append(_rows(["figure", "measured or projected"], [[k, v] for k, v in break_even["sources"].items()]))
    return Markup("<section>{}</section>").format(Markup("").join(parts))


def write_page(path: Path, config, est: dict) -> None:
    """Write the what-if page of estimate `est` (its `projection` and, with a volume, `break_even`) to `path`."""
    style = Markup(
        "body{font:14px system-ui,sans-serif;margin:2em;color:#222}svg text{font-size:12px;fill:#222}"
        ".note{color:#555}table.quality{border-collapse:collapse;margin:.5em 0}table.quality td,table.quality th"
        "{border-bottom:1px solid #ddd;padding:3px 10px;text-align:right}table.quality td:first-child{text-align:left}"
    )
    page = Markup(
        "<!doctype html><html><head><meta charset='utf-8'><title>tokenmill what-if</title><style>{}</style>"
        "</head><body><h1>tokenmill what-if: {}</h1>{}</body></html>"
    ).format(style, config.input.uri, what_if_section(est["projection"], est.get("break_even")))
    path.write_text(str(page), encoding="utf-8")
