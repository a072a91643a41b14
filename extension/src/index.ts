/**
 * distlab's JupyterLab side: a "Distributed" side panel listing the labs running in this
 * server's kernels (GET /distlab/labs, polled), with stop and restart buttons (POST
 * /distlab/labs/<id>/stop or /restart: the server stops or restarts that lab in its kernel,
 * however it was started), a stacks button (GET /distlab/labs/<id>/stacks: every rank's live
 * frames, read by the server from outside the ranks, so it answers while the lab's kernel is busy
 * with a cell that hangs), and a status-bar item for the lab of the current notebook. The panel
 * is a thin view: every fact comes from the Lab, via the server.
 */

import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { URLExt } from '@jupyterlab/coreutils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { ServerConnection } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

/** Each action's button: its label, its label while it runs, its tooltip. */
const ACTION_LABELS: { [what: string]: [string, string, string] } = {
  stop: ['Stop', 'Stopping…', 'Stop this lab, in its kernel (waits for a running cell)'],
  restart: ['Restart', 'Restarting…', 'Restart this lab, in its kernel (waits for a running cell)'],
  step: ['Step', 'Stepping…', 'Every paused rank runs its collective and stops before its next one (lab.step())'],
  continue: ['Continue', 'Continuing…', 'The paused cell runs to its end (lab.cont())']
};

/** How often the panel asks the server (ms). */
const POLL_MS = 2000;

/** One rank, as `%dist status` shows it. */
interface IRank {
  rank: number;
  engine_id: number;
  host: string;
  /** The address the other ranks reach this one at. */
  addr: string;
  pid: number;
  device: string;
  health: string;
}

/** One lab, as GET /distlab/labs returns it. */
export interface ILabInfo {
  id: string;
  kernel_id: string;
  kernel_name: string;
  notebook: string | null;
  world_size: number;
  backend: string;
  launcher: string;
  /** Emulated nodes (network namespaces) and the link between them, when the lab has them. */
  nodes: number | null;
  link: string | null;
  /** In racks (two tiers): the ranks of each rack, and each rack's uplink to the spine. */
  racks?: number[][];
  uplink?: string | null;
  busy: boolean;
  /** `%dist auto on`: the notebook runs every plain cell on these ranks. */
  every_cell?: boolean;
  /** A cell held at a breakpoint (`lab.pause`): every rank waits before this collective. */
  paused?: IPaused | null;
  updated: number;
  ranks: IRank[];
  training: {
    step: number | null;
    steps_per_s: number | null;
    allreduce_s: number | null;
  };
}

/** Where a paused cell's ranks wait (`lab.paused`): the collective, its group, the cell's line. */
export interface IPaused {
  index: number;
  op: string;
  group: string;
  line: number | null;
  /** Ranks about to run another collective than the rest. */
  disagree: number[];
}

/** What the panel may ask of a lab, in its kernel. */
type Action = 'stop' | 'restart' | 'step' | 'continue';

/** A lab kept past its kernel (`%dist start --keep`) that no kernel holds now: a notebook may attach it. */
export interface IKeptLab {
  id: string;
  world_size: number;
  backend: string;
  /** When it ends if nobody attaches it (seconds since the epoch). */
  ends: number;
}

const distlabIcon = new LabIcon({
  name: 'distlab:ranks',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 16 16">' +
    '<g class="jp-icon3" fill="#616161">' +
    '<circle cx="3" cy="3" r="2"/><circle cx="13" cy="3" r="2"/>' +
    '<circle cx="3" cy="13" r="2"/><circle cx="13" cy="13" r="2"/>' +
    '<path d="M4 2.5h8v1H4zM4 12.5h8v1H4zM2.5 4h1v8h-1zM12.5 4h1v8h-1z"/></g></svg>'
});

/** Polls the server for the labs; views subscribe with `onChange`. */
class LabsModel {
  labs: ILabInfo[] = [];
  kept: IKeptLab[] = [];
  error: string | null = null;

  constructor(private _settings: ServerConnection.ISettings) {}

  onChange(fn: () => void): void {
    this._listeners.push(fn);
  }

  start(): void {
    void this.refresh();
    window.setInterval(() => void this.refresh(), POLL_MS); // for the page's lifetime
  }

  /** The lab in the given kernel, if any. */
  forKernel(kernelId: string | undefined): ILabInfo | undefined {
    return kernelId ? this.labs.find(lab => lab.kernel_id === kernelId) : undefined;
  }

  async refresh(): Promise<void> {
    if (this._inFlight) {
      return;
    }
    this._inFlight = true;
    try {
      const url = URLExt.join(this._settings.baseUrl, 'distlab', 'labs');
      const response = await ServerConnection.makeRequest(url, {}, this._settings);
      if (!response.ok) {
        this.error = `the server answered ${response.status} for /distlab/labs`;
      } else {
        const body = (await response.json()) as { labs: ILabInfo[]; kept?: IKeptLab[] };
        this.labs = body.labs;
        this.kept = body.kept ?? [];
        this.error = null;
      }
    } catch (reason) {
      this.error = `cannot reach the server: ${reason}`;
    } finally {
      this._inFlight = false;
    }
    this._listeners.forEach(fn => fn());
  }

  private _listeners: Array<() => void> = [];
  private _inFlight = false;
}

/**
 * Stop or restart a lab: the server runs it in the lab's kernel and answers when it is done (after
 * any cell running there). Resolves with the kernel's one-line message, rejects with the server's.
 */
async function actOnLab(
  settings: ServerConnection.ISettings,
  lab: ILabInfo,
  what: Action
): Promise<string> {
  const url = URLExt.join(settings.baseUrl, 'distlab', 'labs', encodeURIComponent(lab.id), what);
  const response = await ServerConnection.makeRequest(url, { method: 'POST' }, settings);
  let body: { message?: string } = {};
  try {
    body = (await response.json()) as { message?: string };
  } catch {
    // not JSON (a proxy's error page): the status says enough
  }
  if (!response.ok) {
    throw new Error(body.message ?? `the server answered ${response.status}`);
  }
  return body.message ?? '';
}

/**
 * Every rank's live stacks, as text (ranks with the same stack shown once). The server reads them
 * without the lab's kernel. Rejects with the server's one-line message.
 */
async function stacksOfLab(settings: ServerConnection.ISettings, lab: ILabInfo): Promise<string> {
  const url = URLExt.join(settings.baseUrl, 'distlab', 'labs', encodeURIComponent(lab.id), 'stacks');
  const response = await ServerConnection.makeRequest(url, {}, settings);
  let body: { message?: string; text?: string } = {};
  try {
    body = (await response.json()) as { message?: string; text?: string };
  } catch {
    // not JSON (a proxy's error page): the status says enough
  }
  if (!response.ok) {
    throw new Error(body.message ?? `the server answered ${response.status}`);
  }
  return body.text ?? '';
}

/** Where the ranks run: nothing on loopback, else the nodes and their link, and the racks with their uplink. */
function where(lab: ILabInfo): string {
  if (!lab.nodes) {
    return '';
  }
  const nodes = ` on ${lab.nodes} nodes, link ${lab.link ?? 'not shaped'}`;
  if (!lab.racks || lab.racks.length === 0) {
    return nodes;
  }
  const racks = lab.racks.map(ranks => `[${ranks.join(' ')}]`).join(' ');
  return `${nodes}; ranks in ${lab.racks.length} racks ${racks}, uplink ${lab.uplink ?? 'not shaped'}`;
}

function fmtRate(lab: ILabInfo): string {
  const t = lab.training;
  if (t.step === null) {
    return 'no watched training yet (distlab.watch(model) in a %%ddp cell)';
  }
  const parts = [`step ${t.step}`];
  if (t.steps_per_s !== null) {
    parts.push(`${t.steps_per_s.toFixed(1)} steps/s`);
  }
  if (t.allreduce_s !== null) {
    parts.push(`all-reduce ${(t.allreduce_s * 1e3).toFixed(2)} ms/step`);
  }
  return parts.join(' · ');
}

function health(lab: ILabInfo): string {
  const counts = new Map<string, number>();
  lab.ranks.forEach(r => counts.set(r.health, (counts.get(r.health) ?? 0) + 1));
  if (counts.size === 1 && counts.has('ok')) {
    return 'ok';
  }
  return [...counts.entries()].map(([h, n]) => `${n} ${h}`).join(', ');
}

function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  className: string,
  text?: string
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (className) {
    node.className = className;
  }
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

/** The "Distributed" side panel. */
class LabsPanel extends Widget {
  constructor(
    private _model: LabsModel,
    private _act: (lab: ILabInfo, what: Action) => Promise<string>,
    private _readStacks: (lab: ILabInfo) => Promise<string>
  ) {
    super();
    this.id = 'distlab-panel';
    this.addClass('distlab-panel');
    this.title.icon = distlabIcon;
    this.title.caption = 'Distributed: labs running in this server';
    this._model.onChange(() => this.render());
    this.render();
  }

  render(): void {
    const state = JSON.stringify([
      this._model.labs,
      this._model.kept,
      this._model.kept.length > 0 ? Math.floor(Date.now() / 60000) : 0, // a kept lab's minutes left
      this._model.error,
      this._pending,
      this._messages,
      this._stacks
    ]);
    if (state === this._shown) {
      return; // unchanged: keep the DOM (and any focus) as it is
    }
    this._shown = state;
    const root = this.node;
    root.textContent = '';
    root.appendChild(el('h2', 'distlab-title', 'Distributed'));
    if (this._model.error) {
      root.appendChild(el('p', 'distlab-error', this._model.error));
    }
    if (this._model.labs.length === 0 && this._model.kept.length === 0) {
      root.appendChild(
        el('p', 'distlab-empty', 'No lab is running in this server. In a notebook: %load_ext distlab, then %dist start -n 2.')
      );
    }
    for (const lab of this._model.labs) {
      root.appendChild(this._renderLab(lab));
    }
    if (this._model.kept.length > 0) {
      const box = el('section', 'distlab-kept');
      box.appendChild(el('h3', 'distlab-kept-title', 'Kept, waiting for a notebook'));
      for (const kept of this._model.kept) {
        const minutes = Math.max(0, Math.round((kept.ends * 1000 - Date.now()) / 60000));
        const line = el(
          'p',
          'distlab-kept-lab',
          `${kept.id} · ${kept.world_size} ranks · ${kept.backend} · ends in ${minutes} min unless ` +
            `attached: %dist attach ${kept.id}`
        );
        line.dataset.labId = kept.id;
        box.appendChild(line);
      }
      root.appendChild(box);
    }
  }

  private _renderLab(lab: ILabInfo): HTMLElement {
    const box = el('section', 'distlab-lab');
    box.dataset.kernelId = lab.kernel_id;
    box.dataset.labId = lab.id;
    box.dataset.worldSize = String(lab.world_size);
    const name = lab.notebook ?? `kernel ${lab.kernel_id.slice(0, 8)}`;
    box.appendChild(el('h3', 'distlab-notebook', name));
    box.appendChild(
      el(
        'p',
        'distlab-summary',
        `${lab.world_size} ranks${where(lab)} · ` +
          `${lab.backend} · launcher ${lab.launcher} · ${lab.busy ? 'running a cell' : 'idle'}`
      )
    );
    if (lab.every_cell) {
      box.appendChild(el('p', 'distlab-every-cell', 'auto: every plain cell runs on these ranks (%dist auto off)'));
    }
    const paused = lab.paused;
    if (paused) {
      const at = paused.line === null ? '' : `, line ${paused.line}`;
      const differ = paused.disagree.length ? ` · rank ${paused.disagree.join(',')} differs` : '';
      box.appendChild(
        el('p', 'distlab-paused', `paused before collective ${paused.index}: ${paused.op} on ${paused.group}${at}${differ}`)
      );
    }
    box.appendChild(el('p', 'distlab-training', fmtRate(lab)));

    const table = el('table', 'distlab-ranks');
    const head = el('tr', '');
    for (const h of ['rank', 'host', 'pid', 'device', 'health']) {
      head.appendChild(el('th', '', h));
    }
    table.appendChild(head);
    for (const r of lab.ranks) {
      const row = el('tr', 'distlab-rank');
      row.dataset.rank = String(r.rank);
      row.title = `rank ${r.rank} at ${r.addr}`;
      for (const v of [r.rank, r.host, r.pid, r.device]) {
        row.appendChild(el('td', '', String(v)));
      }
      row.appendChild(el('td', `distlab-health distlab-health-${r.health}`, r.health));
      table.appendChild(row);
    }
    box.appendChild(table);

    const buttons = el('div', 'distlab-buttons');
    const pending = this._pending[lab.id];
    const actions: Action[] = paused ? ['step', 'continue', 'restart', 'stop'] : ['restart', 'stop'];
    for (const what of actions) {
      const [label, busyLabel, title] = ACTION_LABELS[what];
      const button = el('button', `jp-Button jp-mod-styled distlab-${what}`, pending === what ? busyLabel : label);
      button.disabled = pending !== undefined;
      button.title = title;
      button.onclick = () => void this._run(lab, what);
      buttons.appendChild(button);
    }
    // Not disabled while a cell runs: that is when a rank's stack is wanted most.
    const stacks = el('button', 'jp-Button jp-mod-styled distlab-stacks-button', 'Stacks');
    stacks.title = "Every rank's live frames now, read from outside the ranks (works while a cell hangs)";
    stacks.onclick = () => void this._showStacks(lab);
    buttons.appendChild(stacks);
    box.appendChild(buttons);
    const message = this._messages[lab.id];
    if (message) {
      box.appendChild(el('p', 'distlab-message', message));
    }
    const shown = this._stacks[lab.id];
    if (shown !== undefined) {
      box.appendChild(el('pre', 'distlab-stacks', shown));
    }
    return box;
  }

  private async _showStacks(lab: ILabInfo): Promise<void> {
    this._stacks[lab.id] = 'reading the ranks…';
    this.render();
    try {
      this._stacks[lab.id] = await this._readStacks(lab);
    } catch (reason) {
      this._stacks[lab.id] = `stacks not read: ${(reason as Error).message}`;
    }
    this.render();
  }

  private async _run(lab: ILabInfo, what: Action): Promise<void> {
    this._pending[lab.id] = what;
    delete this._messages[lab.id];
    this.render();
    try {
      this._messages[lab.id] = await this._act(lab, what);
    } catch (reason) {
      this._messages[lab.id] = `${what} failed: ${(reason as Error).message}`;
    }
    delete this._pending[lab.id];
    await this._model.refresh();
  }

  private _shown = '';
  // By lab id: a kernel may run more than one lab (distlab.start() twice).
  private _pending: { [labId: string]: Action } = {};
  private _messages: { [labId: string]: string } = {};
  private _stacks: { [labId: string]: string } = {};
}

/** Status-bar item: the current notebook's lab, its world size and health. */
class LabStatus extends Widget {
  constructor(
    private _model: LabsModel,
    private _tracker: INotebookTracker | null,
    onClick: () => void
  ) {
    super();
    this.addClass('distlab-status');
    this.node.title = 'distlab: the lab of this notebook (click for the Distributed panel)';
    this.node.onclick = onClick;
    this._model.onChange(() => this.update());
    this._tracker?.currentChanged.connect(() => this.update());
  }

  /** Emitted when the current notebook gains or loses a lab. */
  get presenceChanged(): ISignal<this, void> {
    return this._presenceChanged;
  }

  /** The lab of the current notebook, if it has one. */
  get lab(): ILabInfo | undefined {
    const kernel = this._tracker?.currentWidget?.sessionContext.session?.kernel;
    return this._model.forKernel(kernel?.id);
  }

  protected onUpdateRequest(): void {
    const lab = this.lab;
    this.node.textContent = lab ? `distlab: ${lab.world_size} ranks · ${health(lab)}` : '';
    this.node.dataset.health = lab ? health(lab) : '';
    if ((lab !== undefined) !== this._present) {
      this._present = lab !== undefined;
      this._presenceChanged.emit();
    }
  }

  private _present = false;
  private _presenceChanged = new Signal<this, void>(this);
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'distlab:plugin',
  description: 'The Distributed side panel and status-bar item of distlab.',
  autoStart: true,
  optional: [ILabShell, INotebookTracker, IStatusBar],
  activate: (
    app: JupyterFrontEnd,
    labShell: ILabShell | null,
    tracker: INotebookTracker | null,
    statusBar: IStatusBar | null
  ) => {
    const model = new LabsModel(app.serviceManager.serverSettings);
    const act = (lab: ILabInfo, what: Action) =>
      actOnLab(app.serviceManager.serverSettings, lab, what);
    const panel = new LabsPanel(model, act, lab => stacksOfLab(app.serviceManager.serverSettings, lab));
    app.shell.add(panel, 'left', { rank: 950 });
    if (statusBar) {
      const item = new LabStatus(model, tracker, () => app.shell.activateById(panel.id));
      statusBar.registerStatusItem('distlab:status', {
        item,
        align: 'left',
        rank: 5,
        isActive: () => item.lab !== undefined,
        activeStateChanged: item.presenceChanged
      });
    }
    labShell?.currentChanged.connect(() => void model.refresh());
    model.start();
  }
};

export default plugin;
