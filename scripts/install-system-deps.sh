#!/usr/bin/env bash
# Installs the Debian packages the e2e tests need, only when a binary is missing.
set -euo pipefail
need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v promtool >/dev/null || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null || need+=(prometheus-alertmanager)
command -v amtool >/dev/null || need+=(prometheus-alertmanager)
command -v prometheus-pushgateway >/dev/null || need+=(prometheus-pushgateway)
# the job store's server (Debian keeps initdb/pg_ctl under /usr/lib/postgresql/<v>/bin)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null || need+=(postgresql)
command -v victoria-metrics >/dev/null || need+=(victoria-metrics)  # remote-write, long retention
command -v chromium >/dev/null || need+=(chromium)  # the view's browser test (playwright drives it)
command -v openssl >/dev/null || need+=(openssl)  # a certificate for the job store's TLS test
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "installing Debian packages: ${need[*]}"
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${need[@]}"
