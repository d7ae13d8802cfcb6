"""The adapters: each framework's models <-> `bridge.Tree`, one file per framework."""
