"""Entry point of the standalone executable (PyInstaller): the same ``llmport-agent`` command."""

import sys

from llmport_agent.cli import main

if __name__ == "__main__":
    sys.exit(main())
