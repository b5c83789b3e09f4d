# services.llmgw.agent: one per node, `llmgw agent`.
#
# `settings` is llmgw's own agent.yaml (docs/configuration.md), typed where the module reads
# a value itself and free-form elsewhere. Engines are either pinned here from nixpkgs
# (`engines.<name>.package`, e.g. llama-cpp built with CUDA) or installed by the agent when
# the server's `engines` asks for them.
#
# The flake passes its packages, so `package` defaults to its llmgw:
#   import ./nixos-modules/agent.nix { packages = self.packages; }
{ packages }:
{ config, lib, pkgs, ... }:

let
  inherit (lib) mkIf mkOption mkEnableOption types;
  shared = import ./lib.nix { inherit lib; };
  cfg = config.services.llmgw.agent;
  yaml = pkgs.formats.yaml { };
  configFile = yaml.generate "llmgw-agent.yaml" (shared.withoutNulls cfg.settings);

  # Where an engine's program sits in its nixpkgs package, when `program` is not given.
  enginePrograms = {
    "llama.cpp" = "bin/llama-server";
    "llama.cpp-rpc" = "bin/rpc-server";
    vllm = "bin/vllm";
  };
  programOf = name: engine:
    if engine.program != null then engine.program else enginePrograms.${name} or null;
  renderEngine = name: engine: {
    binary = if engine.binary != null then engine.binary
      else "${engine.package}/${programOf name engine}";
    version = if engine.version != null then engine.version
      else if engine.package != null then engine.package.version or null else null;
  };

  weights = cfg.settings.weights.directories;
  # A shared directory is a filer's mount: reported when missing, never created.
  localWeights = map (d: d.path) (builtins.filter (d: !d.shared) weights);
  inherit (cfg.settings) port_range servers;
  isLoopbackUrl = url: builtins.match "https?://(localhost|127\\.[0-9.]+|\\[::1])(:[0-9]+)?(/.*)?" url != null;
in
{
  imports = shared.renamed "agent" [
    { from = [ "servers" ]; to = [ "settings" "servers" ]; }
    { from = [ "nodeId" ]; to = [ "settings" "node_id" ]; }
    { from = [ "address" ]; to = [ "settings" "address" ]; }
    { from = [ "runtime" ]; to = [ "settings" "runtime" ]; }
    { from = [ "portRange" ]; to = [ "settings" "port_range" ]; }
    { from = [ "fabric" ]; to = [ "settings" "fabric" ]; }
    { from = [ "labels" ]; to = [ "settings" "labels" ]; }
    { from = [ "enginesDir" ]; to = [ "settings" "engines_dir" ]; }
    { from = [ "installOsPackages" ]; to = [ "settings" "install_os_packages" ]; }
    { from = [ "disableEngines" ]; to = [ "settings" "disable_engines" ]; }
    { from = [ "weights" "directories" ]; to = [ "settings" "weights" "directories" ]; }
    { from = [ "weights" "hub" ]; to = [ "settings" "weights" "hub" ]; }
    { from = [ "weights" "tokenFile" ]; to = [ "hubTokenFile" ]; }
    { from = [ "allowPlainHttp" ]; to = [ "settings" "allow_plain_http" ]; }
    { from = [ "logLevel" ]; to = [ "settings" "log_level" ]; }
  ];

  options.services.llmgw.agent = {
    enable = mkEnableOption "the llmgw agent on this node";

    package = shared.packageOption packages pkgs;

    openFirewall = mkOption {
      type = types.bool;
      default = false;
      description = "Open the engines' port range (`settings.port_range`): the gateway and other nodes' ranks connect to them.";
    };

    tls = mkOption {
      default = null;
      description = "The node's identity for https:// servers (agent.yaml `tls`; `llmgw agent join` writes the files).";
      type = types.nullOr (types.submodule {
        options = {
          caFile = shared.publicFile "The cluster CA (`tls.ca_file`).";
          certFile = shared.publicFile "The node's certificate (`tls.cert_file`).";
          keyFile = shared.requiredSecretFile "The node's private key (`tls.key_file`).";
        };
      });
    };

    hubTokenFile = shared.secretFile ''
      File holding the hub token for gated repositories (agent.yaml `weights.token_file`).
    '';

    tracing = shared.tracingOptions "llmgw-agent";

    monitoring.nodeExporter = {
      enable = mkEnableOption ''
        Prometheus' node_exporter on this node, which the server's Prometheus
        (services.llmgw.server.monitoring) finds through the server and scrapes'';
      port = mkOption {
        type = types.port;
        default = 9100;
        description = "node_exporter's port: the server's monitoring.nodeExporterPort.";
      };
      openFirewall = mkOption {
        type = types.bool;
        default = false;
        description = "Open node_exporter's port in the firewall, for the server's Prometheus.";
      };
    };

    engines = mkOption {
      default = { };
      description = ''
        Engines pinned on this node (agent.yaml `engines`): a package from nixpkgs, or a
        binary path. Reported as `configured`; the server places those engines here
        without installing anything.
      '';
      example = lib.literalExpression ''
        { "llama.cpp".package = pkgs.llama-cpp.override { cudaSupport = true; }; }
      '';
      type = types.attrsOf (types.submodule {
        options = {
          package = mkOption {
            type = types.nullOr types.package;
            default = null;
            description = "The engine's package; its version is reported unless `version` is set.";
          };
          program = mkOption {
            type = types.nullOr types.str;
            default = null;
            example = "bin/llama-server";
            description = ''
              The program inside `package`. null: bin/llama-server for llama.cpp,
              bin/rpc-server for llama.cpp-rpc, bin/vllm for vllm.
            '';
          };
          binary = mkOption {
            type = types.nullOr types.str;
            default = null;
            description = "A path on the node instead of a package (`binary`).";
          };
          version = mkOption {
            type = types.nullOr types.str;
            default = null;
            description = "Free text reported with the engine (`version`).";
          };
        };
      });
    };

    settings = mkOption {
      description = ''
        agent.yaml, with llmgw's keys as written there (docs/configuration.md). The keys below
        are typed; any other is written as given and checked by llmgw when the agent starts.
        A null value is left out, so llmgw's default applies.
      '';
      example = lib.literalExpression ''
        {
          servers = [ "https://10.0.0.1:8443" ];
          fabric = "ib-a";
          labels.rack = "r12";
          shard_health.fail_after_s = 60;
        }
      '';
      type = types.submodule {
        freeformType = yaml.type;
        options = {
          servers = mkOption {
            type = types.nonEmptyListOf types.str;
            example = [ "https://10.0.0.1:8443" "https://10.0.0.2:8443" ];
            description = "Control-plane addresses, tried in turn.";
          };
          state_dir = mkOption {
            type = types.str;
            default = "/var/lib/llmgw-agent";
            readOnly = true;
            description = "The service's StateDirectory: installed engines, the node's identity.";
          };
          runtime = mkOption {
            type = types.enum [ "auto" "systemd" "process" ];
            default = "systemd";
            description = ''
              How shards run: systemd transient units (llmgw-shard-*.service) on the system
              manager, so engines keep serving while the agent restarts.
            '';
          };
          port_range = mkOption {
            type = types.addCheck (types.listOf types.port) (l: builtins.length l == 2)
              // { description = "list of two ports"; };
            default = [ 20000 20999 ];
            description = "Ports engines may use, [ low high ].";
          };
          engines_dir = mkOption {
            type = types.nullOr types.str;
            default = null;
            description = "Where the agent installs engines. null: /var/lib/llmgw-agent/engines.";
          };
          install_os_packages = mkOption {
            type = types.bool;
            default = false;
            description = ''
              Let the agent install OS packages an engine build needs. Off: NixOS has no
              imperative package manager; pin engines from nixpkgs instead, or give
              agent-installed (prebuilt) engines their libraries with programs.nix-ld.
            '';
          };
          allow_plain_http = mkOption {
            type = types.bool;
            default = false;
            description = "Dial an http:// control plane off loopback: the stream in the clear.";
          };
          nvml_library = mkOption {
            type = types.nullOr types.str;
            default = "/run/opengl-driver/lib/libnvidia-ml.so.1";
            description = ''
              NVML, which the agent loads to see the GPUs: where NixOS puts the driver's
              libraries (hardware.nvidia). Loaded by path, so no LD_LIBRARY_PATH reaches the engines.
            '';
          };
          weights.directories = mkOption {
            type = types.nonEmptyListOf (types.submodule {
              freeformType = yaml.type;
              options = {
                path = mkOption { type = types.str; description = "A directory of weights."; };
                shared = mkOption {
                  type = types.bool;
                  default = false;
                  description = "A filer other nodes of the fabric see too (NFS, Lustre…): never created, never guessed.";
                };
              };
            });
            default = [ { path = "/var/lib/llmgw-weights"; } ];
            description = "Where weights are looked for; fetched weights go to the first one not shared.";
          };
        };
      };
    };
  };

  config = mkIf cfg.enable {
    assertions = [
      {
        assertion = builtins.elemAt port_range 0 <= builtins.elemAt port_range 1;
        message = "services.llmgw.agent.settings.port_range = [ ${toString port_range} ]: write the lower port first";
      }
      {
        assertion = cfg.tls != null || !lib.any (lib.hasPrefix "https://") servers;
        message = "services.llmgw.agent.settings.servers has https:// addresses but services.llmgw.agent.tls is not set: give the node's certificate files (`llmgw agent join` writes them)";
      }
      {
        assertion = lib.all (s: lib.hasPrefix "https://" s || lib.hasPrefix "http://" s) servers;
        message = "services.llmgw.agent.settings.servers: each address starts with https:// (or http://), e.g. \"https://10.0.0.1:8443\"";
      }
      {
        assertion = cfg.settings.allow_plain_http
          || lib.all (s: !lib.hasPrefix "http://" s || isLoopbackUrl s) servers;
        message = "services.llmgw.agent.settings.servers has a plain http:// address off loopback: use https:// with `tls`, or set settings.allow_plain_http = true to send the stream in the clear";
      }
    ] ++ lib.mapAttrsToList (name: engine: {
      assertion = (engine.package != null) != (engine.binary != null);
      message = "services.llmgw.agent.engines.\"${name}\": set exactly one of package (from nixpkgs) or binary (a path on the node)";
    }) cfg.engines
    ++ lib.mapAttrsToList (name: engine: {
      assertion = engine.package == null || programOf name engine != null;
      message = "services.llmgw.agent.engines.\"${name}\": set program, the path of its program inside the package (e.g. \"bin/${name}\")";
    }) cfg.engines
    ++ shared.secretFileAssertions "services.llmgw.agent" { inherit (cfg) hubTokenFile; }
    ++ shared.secretFileAssertions "services.llmgw.agent.tracing" { inherit (cfg.tracing) headersFile; }
    ++ lib.optionals (cfg.tls != null)
      (shared.secretFileAssertions "services.llmgw.agent.tls" { inherit (cfg.tls) keyFile; });

    services.llmgw.agent.settings = {
      engines = mkIf (cfg.engines != { }) (lib.mapAttrs renderEngine cfg.engines);
      tls = mkIf (cfg.tls != null) {
        ca_file = cfg.tls.caFile;
        cert_file = cfg.tls.certFile;
        key_file = toString cfg.tls.keyFile;
      };
      weights = mkIf (cfg.hubTokenFile != null) { token_file = cfg.hubTokenFile; };
      # The agent runs as root and reads the file where it is.
      tracing = shared.tracingSettings cfg.tracing cfg.tracing.headersFile;
    };

    services.prometheus.exporters.node = mkIf cfg.monitoring.nodeExporter.enable {
      enable = true;
      inherit (cfg.monitoring.nodeExporter) port openFirewall;
    };

    environment.systemPackages = [ cfg.package ];

    systemd.services.llmgw-agent = {
      description = "llmgw agent";
      wantedBy = [ "multi-user.target" ];
      after = [ "network-online.target" ];
      wants = [ "network-online.target" ];
      # Engines keep serving while the agent restarts (their units are PID 1's), so a
      # switch may restart it in one step.
      stopIfChanged = false;
      restartTriggers = [ configFile ];
      environment.PYTHONUNBUFFERED = "1";
      serviceConfig = {
        Type = "exec";
        ExecStart = "${lib.getExe cfg.package} agent --config ${configFile}";
        Restart = "always";
        RestartSec = 2;
        # root: shards are transient units, started over the system manager's private bus
        # (/run/systemd/private), which only root may use. They are PID 1's children, so
        # none of the sandbox below reaches the engines.
        User = "root";
        StateDirectory = "llmgw-agent";
        StateDirectoryMode = "0700";
        # Engines started as plain processes (runtime process) keep serving while the
        # agent restarts: stop only the agent.
        KillMode = "process";
        NoNewPrivileges = true;
        PrivateTmp = true;
        ProtectSystem = "strict";
        # "-": a filer not mounted yet must not stop the agent (it reports it).
        ReadWritePaths = map (path: "-${path}") (map (d: d.path) weights
          ++ lib.optional (cfg.settings.engines_dir != null) cfg.settings.engines_dir);
        ProtectHome = true;
        # GPUs: NVML and the engines need the NVIDIA devices, and nothing else of /dev.
        # Groups as /proc/devices names them: /dev/nvidia0..N and nvidiactl are "nvidia"
        # on current drivers and "nvidia-frontend" on older ones; a group the driver does
        # not register is ignored.
        DevicePolicy = "closed";
        DeviceAllow = [
          "char-nvidia"
          "char-nvidia-frontend"
          "char-nvidiactl"
          "char-nvidia-uvm"
          "char-nvidia-caps"
          "char-nvidia-caps-imex-channels"
          "char-nvidia-nvswitch"
        ];
        ProtectKernelTunables = true;
        ProtectKernelModules = true;
        ProtectKernelLogs = true;
        ProtectClock = true;
        # netlink: pyroute2 reads routes and addresses; AF_UNIX: the systemd bus.
        RestrictAddressFamilies = [ "AF_UNIX" "AF_INET" "AF_INET6" "AF_NETLINK" ];
        RestrictRealtime = true;
        LockPersonality = true;
        SystemCallArchitectures = "native";
      };
    };

    systemd.tmpfiles.rules = map (path: "d ${path} 0755 root root -") localWeights;

    networking.firewall.allowedTCPPortRanges = mkIf cfg.openFirewall [
      { from = builtins.elemAt port_range 0; to = builtins.elemAt port_range 1; }
    ];
  };
}
