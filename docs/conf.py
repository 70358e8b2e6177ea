"""Sphinx configuration of llmport-agent's documentation (built by `tox -e docs`, warnings are errors)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
sys.path.insert(0, os.path.dirname(HERE))  # the agent's own tree, for the generated references

project = "llmport-agent"
author = "llmport-agent contributors"
copyright = "llmport-agent contributors"
extensions = ["myst_parser", "llmport_reference"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_split"]
myst_heading_anchors = 3
html_theme = "alabaster"
# A laptop screen (1280 px) is used whole: the body takes the width the sidebar leaves, and
# custom.css keeps a long code line scrolling inside its block (never cut off at the page edge).
html_theme_options = {"page_width": "96%", "sidebar_width": "240px", "body_max_width": "none"}
html_static_path = ["_static"]
html_css_files = ["custom.css"]
suppress_warnings: list[str] = []
