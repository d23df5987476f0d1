# shellcheck shell=bash
# Shell functions shared by deploy/check.sh and deploy/slurm/check.sh (sourced, not run).

# install_missing WHO PACKAGE...: installs the Debian packages with apt-get when running as
# root; otherwise stops the script, naming them. WHO prefixes the messages.
install_missing() {
    local who="$1"
    shift
    [ $# -gt 0 ] || return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        printf '[%s] installing %s\n' "$who" "$*"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null
        apt-get install -y -qq --no-install-recommends "$@" >/dev/null
    else
        printf '[%s] FAILED: missing tools: %s (install these Debian packages, as root)\n' \
            "$who" "$*" >&2
        exit 1
    fi
}
