# services.llmgw.agent: one per node, `llmgw agent`.
#
# Thin: the options become llmgw's own agent.yaml (lib.nix renderAgent; every key is
# documented in docs/configuration.md) and one ExecStart. Engines are either pinned from
# nixpkgs here (`engines.<name>.package`, for example llama-cpp built with CUDA) or
# installed by the agent when the server asks for them (server.yaml `engines`).
{ config, lib, pkgs, ... }:

let
  inherit (lib) mkIf mkOption mkEnableOption types;
  cfg = config.services.llmgw.agent;
  render = import ./lib.nix;
  yaml = pkgs.formats.yaml { };
  configFile = yaml.generate "llmgw-agent.yaml" (render.renderAgent cfg);
  weights =
    if cfg.weights.directories == null then [ { path = "/var/lib/llmgw-weights"; shared = null; } ]
    else cfg.weights.directories;
  weightsDirectories = map (d: d.path) weights;
  # A shared directory is a filer's mount: reported when missing, never created.
  localWeightsDirectories = map (d: d.path) (builtins.filter (d: d.shared != true) weights);
  portRange = if cfg.portRange == null then [ 20000 20999 ] else cfg.portRange;
in
{
  options.services.llmgw.agent = {
    enable = mkEnableOption "the llmgw agent on this node";

    package = mkOption {
      type = types.package;
      defaultText = lib.literalExpression "llmgw.packages.\${system}.llmgw";
      description = "The llmgw package; the flake's nixosModules set it to its own.";
    };

    servers = mkOption {
      type = types.nonEmptyListOf types.str;
      example = [ "https://10.0.0.1:8443" "https://10.0.0.2:8443" ];
      description = "Control-plane addresses (agent.yaml `servers`), tried in turn.";
    };

    nodeId = mkOption {
      type = types.nullOr types.str;
      default = null;
      description = "The node's name in the cluster (`node_id`). null: the host name.";
    };

    address = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "10.0.0.11";
      description = "Address engines bind to (`address`). null: the source address of the route to the servers.";
    };

    runtime = mkOption {
      type = types.enum [ "auto" "systemd" "process" ];
      default = render.defaults.agent.runtime;
      description = ''
        How shards run (`runtime`): systemd transient units (llmgw-shard-*.service) on the
        system manager, so engines keep serving while the agent restarts.
      '';
    };

    portRange = mkOption {
      type = types.nullOr (types.addCheck (types.listOf types.port) (l: builtins.length l == 2));
      default = null;
      example = [ 20000 20999 ];
      description = "Ports engines may use, [low high] (`port_range`). null: 20000-20999.";
    };

    fabric = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "ib-a";
      description = "The network fabric this node is on (`fabric`); multi-node replicas need one.";
    };

    labels = mkOption {
      type = types.nullOr (types.attrsOf types.str);
      default = null;
      example = { rack = "r12"; };
      description = "Free labels that models select nodes by (`labels`).";
    };

    engines = mkOption {
      default = null;
      description = ''
        Engines pinned on this node (agent.yaml `engines`): a package from nixpkgs, or a
        binary path. Reported as `configured`; the server places those engines here.
      '';
      example = lib.literalExpression ''
        { "llama.cpp".package = pkgs.llama-cpp.override { cudaSupport = true; }; }
      '';
      type = types.nullOr (types.attrsOf (types.submodule {
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
      }));
    };

    enginesDir = mkOption {
      type = types.nullOr types.str;
      default = null;
      description = "Where the agent installs engines (`engines_dir`). null: /var/lib/llmgw-agent/engines.";
    };

    installOsPackages = mkOption {
      type = types.bool;
      default = render.defaults.agent.installOsPackages;
      description = ''
        Let the agent install OS packages an engine build needs (`install_os_packages`).
        Off: NixOS has no imperative package manager; pin engines from nixpkgs instead, or
        give agent-installed (prebuilt) engines their libraries with programs.nix-ld.
      '';
    };

    disableEngines = mkOption {
      type = types.nullOr (types.listOf types.str);
      default = null;
      description = "Engines this node must never run (`disable_engines`).";
    };

    weights = {
      directories = mkOption {
        type = types.nullOr (types.listOf (types.submodule {
          options = {
            path = mkOption { type = types.str; description = "A directory of weights."; };
            shared = mkOption {
              type = types.nullOr types.bool;
              default = null;
              description = "A filer other nodes of the fabric see too (NFS, Lustre…); never guessed.";
            };
          };
        }));
        default = null;
        description = "Where weights are looked for and fetched to (`weights.directories`). null: /var/lib/llmgw-weights.";
      };
      hub = mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "https://hf-mirror.internal";
        description = "The hub hf:// sources come from (`weights.hub`); an air-gapped cluster's mirror.";
      };
      tokenFile = mkOption {
        type = types.nullOr types.str;
        default = null;
        description = "File holding the hub token (`weights.token_file`).";
      };
    };

    tls = mkOption {
      default = null;
      description = "The node's identity for https:// servers (agent.yaml `tls`).";
      type = types.nullOr (types.submodule {
        options = {
          caFile = mkOption { type = types.str; description = "The cluster CA (`tls.ca_file`)."; };
          certFile = mkOption { type = types.str; description = "The node's certificate (`tls.cert_file`)."; };
          keyFile = mkOption { type = types.str; description = "The node's key (`tls.key_file`)."; };
        };
      });
    };

    allowPlainHttp = mkOption {
      type = types.nullOr types.bool;
      default = null;
      description = "Dial an http:// control plane off loopback (`allow_plain_http`). null: refused.";
    };

    logLevel = mkOption {
      type = types.nullOr (types.enum [ "debug" "info" "warning" "error" ]);
      default = null;
      description = "How much the agent logs (`log_level`). null: info.";
    };

    openFirewall = mkOption {
      type = types.bool;
      default = false;
      description = "Open the engines' port range: the gateway and other nodes' ranks connect to them.";
    };

    settings = mkOption {
      type = yaml.type;
      default = { };
      example = { shard_health.fail_after_s = 60; };
      description = "Any other agent.yaml key, as written there; merged over the options above.";
    };
  };

  config = mkIf cfg.enable {
    systemd.services.llmgw-agent = {
      description = "llmgw agent";
      wantedBy = [ "multi-user.target" ];
      after = [ "network-online.target" ];
      wants = [ "network-online.target" ];
      restartTriggers = [ configFile ];
      environment = {
        PYTHONUNBUFFERED = "1";
        # NVML (libnvidia-ml.so.1) comes with the driver NixOS puts here (hardware.nvidia).
        LD_LIBRARY_PATH = "/run/opengl-driver/lib";
      };
      serviceConfig = {
        ExecStart = "${lib.getExe cfg.package} agent --config ${configFile}";
        Restart = "always";
        RestartSec = 2;
        # root: shards are transient units, started over the system manager's private bus
        # (/run/systemd/private), which only root may use. They are PID 1's children, so
        # none of the sandbox below applies to the engines.
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
        ReadWritePaths = map (path: "-${path}") weightsDirectories;
        ProtectHome = true;
        # GPUs: NVML and the engines need /dev/nvidia*, /dev/nvidia-uvm and
        # /dev/nvidia-caps, so no PrivateDevices and no DevicePolicy here.
        PrivateDevices = false;
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

    systemd.tmpfiles.rules = map (path: "d ${path} 0755 root root -") localWeightsDirectories;

    networking.firewall.allowedTCPPortRanges = mkIf cfg.openFirewall [
      { from = builtins.elemAt portRange 0; to = builtins.elemAt portRange 1; }
    ];
  };
}
