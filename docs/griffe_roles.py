"""Griffe extension for the API reference: the reST of the docstrings, read as Markdown.

The docstrings of ``bam_pyro`` are written in reST, which Markdown would print as raw text in three
places, rewritten here:

- roles (:class:`X`, :func:`~a.b.f`) are resolved in the scope of the docstring that holds them,
  the way Sphinx would: a target inside the package becomes a cross-reference (checked by the
  strict build), any other one (Pyro, torch, inherited torch methods) inline code;
- simple tables (columns under ``====  ====`` rules) become Markdown tables;
- a paragraph ending in ``::`` (before a literal block) ends in ``:``;
- field lines (``name: what it is``, at the start of a line, for a parameter or attribute of the
  documented object) become list items, which Markdown would otherwise run into one paragraph.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(class|func|meth|mod|attr|data|exc|obj):`(~?)([\w.]+)(?:\(\))?`")
MEMBER_ROLES = {"meth", "attr"}  # looked up on the documented object first, as Sphinx does
RULE = re.compile(r"^=+( +=+)+$")  # the border of a reST simple table
LITERAL = re.compile(r"(?<=\S)::$", flags=re.M)
FIELD = re.compile(r"^(\w+):(?=\s)", flags=re.M)


def _resolve(scope: griffe.Object, role: str, target: str) -> str | None:
    """The full path of ``target`` seen from ``scope``, or None for a name outside the package.
    An unknown class, function or module inside the package stays a link, so that the strict
    build reports it; an unknown attribute or method may exist at run time only."""
    if role not in MEMBER_ROLES and not scope.is_module:
        scope = scope.module
    head, _, rest = target.partition(".")
    try:
        path = scope.resolve(head)
    except griffe.NameResolutionError:
        path = head
    path = f"{path}.{rest}" if rest else path
    package = scope.package
    if not path.startswith(f"{package.path}."):
        return None
    if role in MEMBER_ROLES and not _exists(package, path):
        return None  # set at run time (a buffer, an instance attribute) or inherited from torch
    return path


def _exists(package: griffe.Module, path: str) -> bool:
    try:
        package[path[len(package.path) + 1 :]]
    except (KeyError, griffe.AliasResolutionError):
        return False
    return True


def _markdown_tables(text: str) -> str:
    """reST simple tables (a border, the header, a border, rows, a border) as Markdown tables."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        if not (RULE.match(lines[i]) and i + 2 < len(lines) and RULE.match(lines[i + 2])):
            out.append(lines[i])
            i += 1
            continue
        starts = [match.start() for match in re.finditer(r"=+", lines[i])]
        end = next((j for j in range(i + 3, len(lines)) if RULE.match(lines[j])), len(lines))

        def row(line: str) -> str:
            cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]  # Markdown keeps a pipe inside code
            return "| " + " | ".join(cells) + " |"

        out += ["", row(lines[i + 1]), "|" + "---|" * len(starts), *map(row, lines[i + 3 : end]), ""]
        i = end + 1
    return "\n".join(out)


def _rewrite(obj: griffe.Object, text: str) -> str:
    def link(match: re.Match) -> str:
        role, short, target = match.groups()
        shown = target.rsplit(".", 1)[-1] if short else target
        path = _resolve(obj, role, target)
        return f"[`{shown}`][{path}]" if path else f"`{shown}`"

    names = _field_names(obj)

    def field(match: re.Match) -> str:
        return f"\n- `{match.group(1)}`:" if match.group(1) in names else match.group(0)

    return FIELD.sub(field, LITERAL.sub(":", ROLE.sub(link, _markdown_tables(text))))


def _field_names(obj: griffe.Object) -> set[str]:
    """The names a docstring of ``obj`` may describe as fields: parameters and attributes."""
    if obj.is_function:
        return {parameter.name for parameter in obj.parameters}
    if obj.is_class:
        return {parameter.name for parameter in obj.parameters} | set(obj.members)
    return set()


class ReSTRoles(griffe.Extension):
    """Rewrite the reST roles of every docstring in a loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        self._visit(pkg)

    def _visit(self, obj: griffe.Object) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _rewrite(obj, obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias:
                self._visit(member)
