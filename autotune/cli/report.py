"""`autotune report STUDY`: the HTML report of a study. Parse arguments, call the package, print."""

from __future__ import annotations

import click


@click.command("report")
@click.argument("study", type=click.Path())
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for report.html and figures/ [default: the study folder].")
def report_command(study: str, out_dir: str | None) -> None:
    """Write STUDY/report.html (self-contained) and the figures as PNG and SVG beside it."""
    from autotune.report_html import report_on_folder

    written = report_on_folder(study, out_dir)
    click.echo(f"wrote {written.page} ({len(written.figures) // 2} figures in {written.figures[0].parent})"
               if written.figures else f"wrote {written.page} (no figure: the page says what is missing)")
