"""Help texts of meshfn's typer apps, reflowed: a docstring wrapped at 100 columns in the source
keeps its line breaks in `--help` (rich prints them as they are), so a sentence broke where the
source line did ("...yourself. It" / "carries..."). Paragraphs (blank-line separated) stay."""

from __future__ import annotations

import inspect
import re

import typer


def reflow(text: str | None) -> str | None:
    """Join the lines of each paragraph with single spaces."""
    if text is None:
        return None
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(text))
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())


def reflow_help(app: typer.Typer) -> typer.Typer:
    """Reflow the help of every command and sub-app of `app`, recursively (before typer builds
    the click commands: call it once every command is registered)."""
    for command in app.registered_commands:
        doc = command.help if command.help is not None else inspect.getdoc(command.callback)
        command.help = reflow(doc)
    for group in app.registered_groups:
        if isinstance(group.help, str):
            group.help = reflow(group.help)
        if group.typer_instance is not None:
            info = group.typer_instance.info
            if isinstance(info.help, str):
                info.help = reflow(info.help)
            reflow_help(group.typer_instance)
    if isinstance(app.info.help, str):
        app.info.help = reflow(app.info.help)
    return app
