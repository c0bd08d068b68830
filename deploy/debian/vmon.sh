#!/bin/sh
# /usr/bin/vmon: the binary lives in /usr/lib/vmon beside envd, which the node bakes into guest
# images and finds beside its own (resolved) path.
exec /usr/lib/vmon/vmon "$@"
