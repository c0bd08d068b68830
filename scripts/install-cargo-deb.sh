#!/usr/bin/env bash
# Builds cargo-deb (scripts/package.sh makes the Debian package with it) once into
# /var/tmp/vmon-tools (scripts/install-cargo-tool.sh); prints the binary's path.
exec "$(dirname "$0")/install-cargo-tool.sh" cargo-deb 3.8.0
