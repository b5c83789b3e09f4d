# From the modules' option values to llmgw's own server.yaml and agent.yaml, as plain
# attrsets (the modules write them with pkgs.formats.yaml).
#
# builtins only, no nixpkgs: tests/unit/test_nix.py evaluates these with a bare
# `nix-instantiate --eval` and compares the result with nixos-modules/examples/*.yaml.
# An option left null is not written, so llmgw's own default (llmgw/config.py) applies:
# defaults are defined once, there. A cfg may leave out any attribute the example does
# not use.
let
  # Later values win; attrsets merge key by key, anything else is replaced.
  recursiveUpdate = left: right:
    left // builtins.mapAttrs
      (name: value:
        if builtins.isAttrs value && builtins.isAttrs (left.${name} or null)
        then recursiveUpdate left.${name} value
        else value)
      right;

  # The attributes whose value is not null.
  setOnly = attrs: builtins.removeAttrs attrs
    (builtins.filter (name: attrs.${name} == null) (builtins.attrNames attrs));

  get = cfg: path: default:
    let
      step = value: name:
        if value != null && builtins.isAttrs value then value.${name} or null else null;
      found = builtins.foldl' step cfg path;
    in
    if found == null then default else found;

  defaults = {
    server = { host = "127.0.0.1"; port = 8080; stateDir = "/var/lib/llmgw"; };
    agent = { stateDir = "/var/lib/llmgw-agent"; runtime = "systemd"; installOsPackages = false; };
  };

  # Files the server reads are handed to it as systemd credentials: it runs as a dynamic
  # user that cannot read the operator's files.
  serverCredentials = "/run/credentials/llmgw-server.service";
  serverTlsFiles = {
    caFile = { key = "ca_file"; credential = "tls-ca"; };
    caKeyFile = { key = "ca_key_file"; credential = "tls-ca-key"; };
    certFile = { key = "cert_file"; credential = "tls-cert"; };
    keyFile = { key = "key_file"; credential = "tls-key"; };
  };

  # Where an engine's program sits in its nixpkgs package, when `program` is not given.
  enginePrograms = {
    "llama.cpp" = "bin/llama-server";
    "llama.cpp-rpc" = "bin/rpc-server";
    vllm = "bin/vllm";
  };

  renderServer = cfg:
    let
      tls = get cfg [ "tls" ] null;
      rendered = setOnly {
        listen = setOnly {
          host = get cfg [ "listen" "host" ] defaults.server.host;
          port = get cfg [ "listen" "port" ] defaults.server.port;
          allow_plain_http = get cfg [ "allowPlainHttp" ] null;
        };
        state_dir = defaults.server.stateDir;
        store = if get cfg [ "store" "url" ] null == null then null
          else { url = cfg.store.url; };
        tls = if tls == null then null else
          builtins.listToAttrs (map
            (option: {
              name = serverTlsFiles.${option}.key;
              value = "${serverCredentials}/${serverTlsFiles.${option}.credential}";
            })
            (builtins.attrNames serverTlsFiles))
          // setOnly {
            agent_listen = get tls [ "agentListen" ] null;
            public_urls = get tls [ "publicUrls" ] null;
            node_cert_days = get tls [ "nodeCertDays" ] null;
          };
        metrics = if get cfg [ "metricsTokenFile" ] null == null then null
          else { token_file = "${serverCredentials}/metrics-token"; };
        models = get cfg [ "models" ] null;
        engines = get cfg [ "engines" ] null;
        engine_mirror = get cfg [ "engineMirror" ] null;
        log_level = get cfg [ "logLevel" ] null;
      };
    in
    recursiveUpdate rendered (get cfg [ "settings" ] { });

  renderEngine = name: engine:
    let
      package = engine.package or null;
      binary = engine.binary or null;
      program = if (engine.program or null) != null then engine.program
        else enginePrograms.${name} or (throw
          "services.llmgw.agent.engines.\"${name}\": set program (the path of its program inside the package) or binary");
      version = if (engine.version or null) != null then engine.version
        else if package != null then package.version or "" else "";
    in
    if binary == null && package == null
    then throw "services.llmgw.agent.engines.\"${name}\": set package (from nixpkgs) or binary (a path on the node)"
    else { binary = if binary != null then binary else "${package}/${program}"; }
      // (if version == "" then { } else { inherit version; });

  renderAgent = cfg:
    let
      weights = get cfg [ "weights" ] { };
      rendered = setOnly {
        servers = cfg.servers;
        node_id = get cfg [ "nodeId" ] null;
        address = get cfg [ "address" ] null;
        state_dir = defaults.agent.stateDir;
        runtime = get cfg [ "runtime" ] defaults.agent.runtime;
        port_range = get cfg [ "portRange" ] null;
        fabric = get cfg [ "fabric" ] null;
        labels = get cfg [ "labels" ] null;
        engines = let engines = get cfg [ "engines" ] null; in
          if engines == null then null else builtins.mapAttrs renderEngine engines;
        engines_dir = get cfg [ "enginesDir" ] null;
        install_os_packages = get cfg [ "installOsPackages" ] defaults.agent.installOsPackages;
        disable_engines = get cfg [ "disableEngines" ] null;
        weights = let
          w = setOnly {
            directories = get weights [ "directories" ] null;
            hub = get weights [ "hub" ] null;
            token_file = get weights [ "tokenFile" ] null;
          };
        in if w == { } then null else w;
        tls = let tls = get cfg [ "tls" ] null; in
          if tls == null then null
          else { ca_file = tls.caFile; cert_file = tls.certFile; key_file = tls.keyFile; };
        allow_plain_http = get cfg [ "allowPlainHttp" ] null;
        log_level = get cfg [ "logLevel" ] null;
      };
    in
    recursiveUpdate rendered (get cfg [ "settings" ] { });
in
{
  inherit defaults enginePrograms recursiveUpdate renderServer renderAgent serverCredentials
    serverTlsFiles;
}
