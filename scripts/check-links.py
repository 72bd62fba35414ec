#!/usr/bin/env python3
"""Fails when a link inside the built guide (target/book) or a relative link of README.md is broken.

Checked: every relative href/src of every HTML page the book built resolves to a file, and its #fragment (also a
same-page one) to an element id of that page; README.md's relative links resolve to files, with the heading
anchors GitHub makes. External links (http, https, mailto) are not fetched: CI has no network to check them
with. Written here rather than taken from mdbook-linkcheck, which lags mdbook 0.5's renderer interface.
"""
import html.parser
import os
import re
import sys
import urllib.parse


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.links = set(), []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("id", "name") and value:
                self.ids.add(value)
            if name in ("href", "src") and value:
                self.links.append(value)


def parse(path, cache={}):
    if path not in cache:
        page = Page()
        with open(path, encoding="utf-8") as f:
            page.feed(f.read())
        cache[path] = page
    return cache[path]


def external(link):
    return re.match(r"^[a-z][a-z0-9+.-]*:", link) is not None


def check_book(book):
    errors = []
    for folder, _, files in os.walk(book):
        for name in files:
            if not name.endswith(".html"):
                continue
            page_path = os.path.join(folder, name)
            for link in parse(page_path).links:
                if external(link) or link.startswith("//"):
                    continue
                target, _, fragment = link.partition("#")
                target = urllib.parse.unquote(target)
                if target.startswith("/"):  # the site's root (404.html's base)
                    target_path = os.path.normpath(os.path.join(book, target.lstrip("/")))
                else:
                    target_path = os.path.normpath(os.path.join(folder, target)) if target else page_path
                if os.path.isdir(target_path):
                    target_path = os.path.join(target_path, "index.html")
                where = os.path.relpath(page_path, book)
                if not os.path.exists(target_path):
                    errors.append(f"{where}: {link}: no such file")
                elif fragment and target_path.endswith(".html") and fragment not in parse(target_path).ids:
                    errors.append(f"{where}: {link}: no element with id `{fragment}`")
    return errors


def github_anchor(heading):
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def check_readme(root):
    errors = []
    readme = os.path.join(root, "README.md")
    text = open(readme, encoding="utf-8").read()
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if external(link):
            continue
        target, _, fragment = link.partition("#")
        path = os.path.join(root, target) if target else readme
        if not os.path.exists(path):
            errors.append(f"README.md: {link}: no such file")
        elif fragment and path.endswith(".md"):
            headings = re.findall(r"^#+ (.*)$", open(path, encoding="utf-8").read(), re.M)
            if fragment not in {github_anchor(h) for h in headings}:
                errors.append(f"README.md: {link}: no heading with that anchor")
    return errors


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    book = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "target", "book")
    if not os.path.exists(os.path.join(book, "index.html")):
        sys.exit(f"{book}: no built book here (run `make docs` or `mdbook build docs/book`)")
    errors = check_book(book) + check_readme(root)
    for e in errors:
        print(e, file=sys.stderr)
    pages = sum(1 for _, _, fs in os.walk(book) for f in fs if f.endswith(".html"))
    if errors:
        sys.exit(f"{len(errors)} broken link(s)")
    print(f"links: {pages} pages of {book} and README.md, none broken")


if __name__ == "__main__":
    main()
