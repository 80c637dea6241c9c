"""The rows the papers compare against (issue 60): one reference implementation per file, on common.py's loop."""
