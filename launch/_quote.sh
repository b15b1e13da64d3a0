# Sourced by the launch scripts: q ARGS... prints the arguments shell-quoted (plain words stay
# bare), joined by spaces, ready to paste or to pass through ssh / xpk's bash -c.
q() {
  local out="" s
  for s in "$@"; do
    if [[ $s =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then out+="$s "
    elif [[ $s == *$'\n'* ]]; then out+="$(printf '%q' "$s") "
    else out+="'${s//\'/\'\\\'\'}' "; fi
  done
  printf '%s' "${out% }"
}
