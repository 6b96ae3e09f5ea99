"""One module per command (or small group of commands); each registers itself on `benchctl.cli.app`."""
