#!/bin/sh
# The command of an ulfmtrain container, under tini.  `sshd` makes the container a host of a job that
# spans containers (docker/README.md): it takes the job's key from the volume at /ssh (mounted, or made
# there by the first container to start), makes this container's own host key, publishes its public half
# in /ssh/hosts/HOSTNAME for the others' known_hosts, and runs sshd.  Any other command runs as given.
set -eu
if [ "${1-}" != sshd ]; then
    exec "$@"
fi
shift
ssh_dir=/ssh
if ! [ -w "$ssh_dir" ]; then
    echo "ulfmtrain: $ssh_dir is not writable by $(id -un): mount the job's ssh volume there (-v ulfmtrain-ssh:/ssh)" >&2
    exit 2
fi
mkdir -p "$ssh_dir/hosts" "$HOME/.ssh" "$HOME/.sshd"
chmod 700 "$HOME/.ssh" "$HOME/.sshd"
(
    flock 9
    if ! [ -f "$ssh_dir/id_ed25519" ]; then
        ssh-keygen -q -t ed25519 -N '' -C "ulfmtrain job" -f "$ssh_dir/id_ed25519"
    fi
) 9> "$ssh_dir/.lock"
# restrict: the job's key runs commands, nothing else (no forwarding, no pty).
printf 'restrict %s\n' "$(cat "$ssh_dir/id_ed25519.pub")" > "$HOME/.ssh/authorized_keys"
chmod 600 "$HOME/.ssh/authorized_keys"
key=$HOME/.sshd/ssh_host_ed25519_key
if ! [ -f "$key" ]; then
    ssh-keygen -q -t ed25519 -N '' -C "$(uname -n)" -f "$key"
fi
host=$(uname -n)
printf '[%s]:2222 %s\n' "$host" "$(cut -d' ' -f1,2 "$key.pub")" > "$ssh_dir/hosts/.$host.new"
mv -f "$ssh_dir/hosts/.$host.new" "$ssh_dir/hosts/$host"
exec /usr/sbin/sshd -D -e -f /etc/ulfmtrain/sshd_config "$@"
