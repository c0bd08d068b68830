#!/usr/bin/env bash
# Builds cargo-deny (the dependency policy scripts/test.sh checks: licences, bans, sources,
# advisories when a database is at hand) once into /var/tmp/vmon-tools
# (scripts/install-cargo-tool.sh); prints the binary's path.
exec "$(dirname "$0")/install-cargo-tool.sh" cargo-deny 0.20.2
