# What the server and agent modules share: the file options for secrets, and turning
# `settings` into llmgw's own YAML.
{ lib }:

let
  inherit (lib) mkOption types;
in
rec {
  # A file the service reads at start. A string naming a path on the machine, never a Nix
  # path literal: Nix would copy the file into /nix/store, readable by every user. The type
  # takes a path too, so that secretFileAssertions can say so in words instead of a type error.
  secretFile = description: mkOption {
    type = types.nullOr (types.either types.str types.path);
    default = null;
    example = "/run/secrets/llmgw";
    inherit description;
  };

  # A role's package: the flake's own llmgw unless set, and on the machine's PATH.
  packageOption = packages: pkgs: mkOption {
    type = types.package;
    default = packages.${pkgs.stdenv.hostPlatform.system}.llmgw;
    defaultText = lib.literalExpression "llmgw.packages.\${pkgs.stdenv.hostPlatform.system}.llmgw";
    description = "The llmgw package; `llmgw` is also put on the machine's PATH (ctl, doctor).";
  };

  # A file anyone may read (a certificate): a path on the machine, or a Nix path, which is
  # copied into the store with the system.
  publicFile = description: mkOption {
    type = types.either types.str types.path;
    apply = value: if builtins.isPath value then "${value}" else value;
    inherit description;
  };

  # A secret file inside a submodule: the same types as secretFile, but required.
  requiredSecretFile = description: mkOption {
    type = types.either types.str types.path;
    inherit description;
  };

  # One assertion per secret file option: a path on the machine, outside the Nix store.
  secretFileAssertions = prefix: files: lib.mapAttrsToList
    (name: value: {
      assertion = value == null
        || (builtins.isString value && lib.hasPrefix "/" value
            && !lib.hasPrefix builtins.storeDir value);
      message = "${prefix}.${name} = ${toString value}: "
        + (if builtins.isPath value || lib.hasPrefix builtins.storeDir (toString value)
           then "a Nix path is copied into ${builtins.storeDir}, which every user can read; "
             + "give the file's path on the machine as a string instead, e.g. \"/run/secrets/llmgw\""
           else "give an absolute path, e.g. \"/run/secrets/llmgw\"");
    })
    files;

  # Options of earlier versions of a role, now elsewhere (mostly keys of `settings`): a
  # definition still applies, with a warning that names the new place.
  renamed = role: map ({ from, to }:
    lib.mkRenamedOptionModule ([ "services" "llmgw" role ] ++ from) ([ "services" "llmgw" role ] ++ to));

  # llmgw's file from `settings`: an option left null is not written, so llmgw's own
  # default applies (docs/configuration.md); nor is a section of nothing but nulls. An
  # empty section given as such stays: `engines = { }` means "install none".
  withoutNulls = value:
    let
      onlyNulls = v: builtins.isAttrs v && v != { }
        && lib.all (x: x == null || onlyNulls x) (builtins.attrValues v);
    in
    if builtins.isAttrs value then
      lib.mapAttrs (_: withoutNulls) (lib.filterAttrs (_: v: v != null && !onlyNulls v) value)
    else if builtins.isList value then map withoutNulls value
    else value;

  # llmgw and systemd read the same address: an IP address or localhost.
  isAddress = host: host == "localhost"
    || builtins.match "[0-9]{1,3}(\\.[0-9]{1,3}){3}" host != null
    || builtins.match "[0-9a-fA-F:.]*:[0-9a-fA-F:.]*" host != null;

  isLoopback = host: builtins.elem host [ "localhost" "::1" ] || lib.hasPrefix "127." host;

  # host:port as systemd's ListenStream= takes it: IPv6 in brackets.
  hostPort = host: port:
    let address = if host == "localhost" then "127.0.0.1" else host; in
    if lib.hasInfix ":" address then "[${address}]:${toString port}"
    else "${address}:${toString port}";

  # `tracing`, as both roles take it: OpenTelemetry traces sent over OTLP/HTTP.
  tracingOptions = defaultName: {
    endpoint = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "http://127.0.0.1:4318/v1/traces";
      description = "The collector's OTLP/HTTP traces URL (`tracing.endpoint`). null: no tracing.";
    };
    headersFile = secretFile ''
      File of `Name: value` lines sent with every export, such as a collector's API key
      (`tracing.headers_file`).
    '';
    sampleRatio = mkOption {
      type = types.nullOr (types.numbers.between 0 1);
      default = null;
      example = 0.25;
      description = "The share of requests traced when the client sent no `traceparent` (`tracing.sample_ratio`). null: llmgw's 0.1.";
    };
    serviceName = mkOption {
      type = types.nullOr types.str;
      default = null;
      description = "The spans' service.name (`tracing.service_name`). null: ${defaultName}.";
    };
  };

  # The YAML `tracing` block of those options, `headersFile` as the service reads it. Only
  # the keys set, and no block when none is: `settings.tracing` written by hand merges
  # with them.
  tracingSettings = tracing: headersFile:
    let
      set = lib.filterAttrs (_: v: v != null) {
        inherit (tracing) endpoint;
        headers_file = headersFile;
        sample_ratio = tracing.sampleRatio;
        service_name = tracing.serviceName;
      };
    in
    lib.mkIf (set != { }) set;

  # Where a process on the same machine reaches a listener on `host`: a wildcard address
  # (every interface) over loopback, any other address as it is.
  localHost = host:
    if host == "0.0.0.0" || host == "localhost" then "127.0.0.1"
    else if host == "::" then "::1"
    else host;

  # A `listen`-shaped block (server.yaml `listen`, `tls.agent_listen`).
  listenOptions = { host, port }: {
    host = mkOption {
      type = types.str;
      default = host;
      example = "0.0.0.0";
      description = "Address to listen on: an IP address (IPv4 or IPv6) or localhost.";
    };
    port = mkOption {
      type = types.port;
      default = port;
      description = "TCP port.";
    };
  };
}
